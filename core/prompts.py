"""What a prompt or a chat may be, checked before anything runs (light: the CLI imports it early)."""

from __future__ import annotations

from typing import Any

from turnout.errors import RequestError

# text, token ids, or vLLM's dict prompts {"prompt": text} / {"prompt_token_ids": [ids]}
Prompt = str | list[int] | dict[str, Any]
Conversation = list[dict[str, str]]
ParsedPrompt = tuple[str | None, str | list[int]]  # (text to report, what the engine takes)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text, token ids, dict) or a sequence of prompts, as a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return [list(prompts)] if prompts and all(map(_is_int, prompts)) else list(prompts)
    raise RequestError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")


def parse_prompt(p: Any) -> ParsedPrompt:
    """(text or None, what the engine takes) of text, token ids, {"prompt": text} or
    {"prompt_token_ids": ids}; RequestError for anything else."""
    if isinstance(p, str):
        return p, p
    if isinstance(p, dict):
        if len(p) != 1 or not {"prompt", "prompt_token_ids"} & set(p):
            keys = ", ".join(map(repr, p)) or "none"
            raise RequestError(f'a dict prompt holds "prompt" (text) or "prompt_token_ids"; got keys {keys}')
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise RequestError(f'"prompt" must be text, got {type(p["prompt"]).__name__}')
            return p["prompt"], p["prompt"]
        p = p["prompt_token_ids"]
    if isinstance(p, (list, tuple)) and all(map(_is_int, p)):
        return None, list(p)
    kind = type(p).__name__
    raise RequestError(f'a prompt is text, a list of token ids, or {{"prompt": text}}; got {kind}')


def check_conversation(messages: Any) -> Conversation:
    """A conversation is a non-empty list of {"role": str, "content": str}; RequestError names what is not."""
    if not isinstance(messages, list) or not messages:
        raise RequestError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(
                f'message {i} must be an object with "role" and "content", got {type(m).__name__}'
            )
        if extra := sorted(set(m) - {"role", "content"}):
            raise RequestError(f'message {i} has key {extra[0]!r}; a message holds "role" and "content"')
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise RequestError(f'message {i} needs a "{key}" string')
    return messages


def context_problem(prompt_len: int, max_tokens: int, max_model_len: int, model_max: int = 0) -> str | None:
    """Why a prompt of prompt_len tokens with max_tokens to generate does not fit max_model_len, or None.
    Every front door refuses both cases before anything runs (the server with 413). model_max, the model's
    own limit, shapes the advice."""
    if prompt_len >= max_model_len:
        fix = (
            f"or raise max_model_len (the model allows up to {model_max})"
            if model_max > max_model_len
            else f"to at most {max_model_len - 1} tokens (the model's limit is {max_model_len})"
        )
        return (
            f"prompt is {prompt_len} tokens, but max_model_len is {max_model_len}; shorten the prompt {fix}"
        )
    if prompt_len + max_tokens > max_model_len:
        return (
            f"this model's context is {max_model_len} tokens, but the request needs {prompt_len} (prompt) + "
            f"{max_tokens} (max_tokens) = {prompt_len + max_tokens}; lower max_tokens to at most "
            f"{max_model_len - prompt_len} or shorten the prompt"
        )
    return None
