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
