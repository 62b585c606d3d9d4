"""/v1/chat/completions: messages through the tokenizer's chat template, n samples."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from turnout.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, OpenAIError
from turnout.entrypoints.openai.serving_engine import Choice, OpenAIServing, completion_tokens, usage

ROLES = ("system", "developer", "user", "assistant")


class OpenAIServingChat(OpenAIServing):
    async def create(self, req: ChatCompletionRequest) -> Any:
        model = self.check_model(req.model)
        self._check_unsupported(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, asked, logprobs)
        prompt = self._prompt(req.messages)
        if asked is None:  # OpenAI's default: as many as the context has room for
            self.check_length(prompt, 1, "messages")
            params = dataclasses.replace(params, max_tokens=self.engine.max_model_len - len(prompt))
        self.check_length(prompt, params.max_tokens, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reqs, choices = self.requests(rid, [prompt], [params], bool(req.stream))
        outputs = await self.run(reqs, bool(req.stream))
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
        if req.stream:
            return StreamingResponse(
                self._stream(req, base, outputs, choices, len(prompt)), media_type="text/event-stream"
            )
        await self.collect(outputs, choices)
        out = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.logprobs) if logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in sorted(choices.values(), key=lambda c: c.index)
        ]
        return JSONResponse({**base, "choices": out, "usage": usage(len(prompt), completion_tokens(choices))})

    def _stream(
        self, req: ChatCompletionRequest, base: dict, outputs: Any, choices: dict[str, Choice], n_prompt: int
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

        def chunk(c: Choice, delta: str, k: int, finish: str | None) -> dict[str, Any]:
            lp = self._logprobs(c.logprobs[-k:]) if k else None
            d = {"content": delta} if delta or finish is None else {}
            choice = {"index": c.index, "delta": d, "logprobs": lp, "finish_reason": finish}
            return {**base, "choices": [choice], **u}

        return self.sse_stream(outputs, choices, chunk, head, base if include_usage else None, n_prompt)

    def _check_unsupported(self, req: ChatCompletionRequest) -> None:
        if req.tools:
            raise OpenAIError(400, "tools are not supported; leave them out", param="tools")
        if req.tool_choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice is not supported; leave it out", param="tool_choice")
        if req.response_format not in (None, {"type": "text"}):
            raise OpenAIError(400, "response_format is not supported (only text)", param="response_format")

    def _prompt(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise OpenAIError(400, "messages is empty; send at least one message", param="messages")
        conv = [self._message(m, i) for i, m in enumerate(messages)]
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise OpenAIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            raise OpenAIError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template writes the special tokens

    def _message(self, m: ChatMessage, i: int) -> dict[str, str]:
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
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
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
