"""/v1/chat/completions: messages (and tools) through the tokenizer's chat template, n samples, tool calls
read out of the output (`tool_choice`)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from turnout.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, OpenAIError
from turnout.entrypoints.openai.serving_engine import Choice, OpenAIServing, completion_tokens, usage
from turnout.entrypoints.openai.tool_choice import ToolChoice, ToolStream
from turnout.tool_parsers import ToolParser

ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: Any, model_names: list[str], tool_parser: type[ToolParser] | None = None,
        enable_auto_tool_choice: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(engine, model_names)
        self.tool_parser, self.enable_auto_tool_choice = tool_parser, enable_auto_tool_choice

    async def create(self, req: ChatCompletionRequest) -> Any:
        model = self.check_model(req.model)
        tools = ToolChoice(req, self.tool_parser, self.enable_auto_tool_choice)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, asked, logprobs, tools.structured_outputs())
        prompt = self._prompt(req)
        if asked is None:  # OpenAI's default: as many as the context has room for
            self.check_length(prompt, 1, "messages")
            params = dataclasses.replace(params, max_tokens=self.engine.max_model_len - len(prompt))
        self.check_length(prompt, params.max_tokens, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reqs, choices = self.requests(rid, [prompt], [params], bool(req.stream))
        try:
            outputs = await self.run(reqs, bool(req.stream))
        except OpenAIError as e:
            raise tools.engine_error(e) from None
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
        if req.stream:
            body = self._stream(req, base, outputs, choices, len(prompt), tools)
            return StreamingResponse(body, media_type="text/event-stream")
        await self.collect(outputs, choices)
        out = []
        for c in sorted(choices.values(), key=lambda c: c.index):
            message, called = tools.message(c.text, self.tokenizer, c.finish_reason)
            out.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c.logprobs) if logprobs is not None else None,
                    "finish_reason": "tool_calls"
                    if called and c.finish_reason == "stop"
                    else c.finish_reason,
                }
            )
        return JSONResponse({**base, "choices": out, "usage": usage(len(prompt), completion_tokens(choices))})

    def _stream(
        self,
        req: ChatCompletionRequest,
        base: dict,
        outputs: Any,
        choices: dict[str, Choice],
        n_prompt: int,
        tools: ToolChoice,
    ) -> Any:
        base = {**base, "object": "chat.completion.chunk"}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        u = {"usage": None} if include_usage else {}
        role = {"role": "assistant", "content": ""}
        head = [
            {
                **base,
                "choices": [{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}],
                **u,
            }
            for c in sorted(choices.values(), key=lambda c: c.index)
        ]

        streams = (
            {c.index: tools.stream(self.tokenizer) for c in choices.values()} if tools.mode != "none" else {}
        )

        def chunk(c: Choice, delta: str, k: int, finish: str | None) -> dict[str, Any] | None:
            lp = self._logprobs(c.logprobs[-k:]) if k else None
            if (ts := streams.get(c.index)) is None:
                d = {"content": delta} if delta or finish is None else {}
            else:
                d, finish = _tool_delta(ts, delta, finish)
            if not (d or lp or finish):
                return None  # a parser holding text back: nothing to send yet
            choice = {"index": c.index, "delta": d, "logprobs": lp, "finish_reason": finish}
            return {**base, "choices": [choice], **u}

        return self.sse_stream(outputs, choices, chunk, head, base if include_usage else None, n_prompt)

    def _prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise OpenAIError(400, "messages is empty; send at least one message", param="messages")
        conv = [self._message(m, i) for i, m in enumerate(req.messages)]
        tokenizer = self.need_tokenizer("chat conversations", "messages")
        if getattr(tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = tokenizer.apply_chat_template(
                conv, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:
            raise OpenAIError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from None
        return tokenizer.encode(text, add_special_tokens=False)  # the template writes the special tokens

    def _message(self, m: ChatMessage, i: int) -> dict[str, Any]:
        if m.role not in ROLES:
            raise OpenAIError(
                400,
                f"messages[{i}].role '{m.role}' is unknown; use one of {', '.join(ROLES)}",
                param=f"messages.{i}.role",
            )
        content = m.content or ""
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise OpenAIError(
                    400,
                    f"messages[{i}]: only text content parts are supported",
                    param=f"messages.{i}.content",
                )
            content = "".join(p.text for p in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:  # templates take the arguments as an object
            msg["tool_calls"] = [
                {
                    "id": t.id,
                    "type": t.type,
                    "function": {"name": t.function.name, "arguments": _args(t.function.arguments)},
                }
                for t in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        return msg if m.name is None else {**msg, "name": m.name}  # the template decides what a name does

    def _logprobs(self, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict:
        """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the top N."""

        def item(token_id: int, lp: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(lp, -9999.0), "bytes": list(text.encode())}

        return {
            "content": [
                {**item(t, lp), "top_logprobs": [item(x, v) for x, v in top]} for t, lp, top in entries
            ]
        }


def _args(text: str) -> Any:
    """A call's arguments as the object they encode, or the text where it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_delta(ts: ToolStream, delta: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed chunk's delta under tools, and its finish_reason ("tool_calls" where calls were made)."""
    content, calls = ts.feed(delta) if delta else ("", [])
    if finish is not None:
        more, rest = ts.finish()
        content, calls = content + more, calls + rest
        if ts.called and finish == "stop":
            finish = "tool_calls"
    d: dict[str, Any] = {"content": content} if content else {}
    if calls:
        d["tool_calls"] = calls
    return d, finish
