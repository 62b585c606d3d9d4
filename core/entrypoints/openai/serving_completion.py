"""/v1/completions: text or token-id prompts, one or several, n samples each."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from turnout.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from turnout.entrypoints.openai.serving_engine import Choice, OpenAIServing, completion_tokens, usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest) -> Any:
        model = self.check_model(req.model)
        for name, value, neutral in (("echo", req.echo, False), ("suffix", req.suffix, None)):
            if value not in (None, neutral):
                raise OpenAIError(400, f"{name} is not supported; leave it out", param=name)
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise OpenAIError(
                400, "best_of is not supported (only best_of == n); leave it out", param="best_of"
            )
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = self.sampling_params(req, max_tokens, req.logprobs)
        prompts = self._prompts(req.prompt)
        for ids in prompts:
            self.check_length(ids, params.max_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        reqs, choices = self.requests(rid, prompts, [params] * len(prompts), bool(req.stream))
        outputs = await self.run(reqs, bool(req.stream))
        created, n_prompt = int(time.time()), sum(len(p) for p in prompts)
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            u = {"usage": None} if include_usage else {}

            def chunk(c: Choice, delta: str, k: int, finish: str | None) -> dict[str, Any]:
                lp = self._logprobs(c.logprobs[-k:], c.sent - len(delta)) if k else None
                choice = {"index": c.index, "text": delta, "logprobs": lp, "finish_reason": finish}
                return {**base, "choices": [choice], **u}

            body = self.sse_stream(outputs, choices, chunk, [], base if include_usage else None, n_prompt)
            return StreamingResponse(body, media_type="text/event-stream")
        await self.collect(outputs, choices)
        out = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": self._logprobs(c.logprobs, 0) if params.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in sorted(choices.values(), key=lambda c: c.index)
        ]
        return JSONResponse({**base, "choices": out, "usage": usage(n_prompt, completion_tokens(choices))})

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError(400, "prompt is empty; send text or token ids", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [self._encode(p) if isinstance(p, str) else p for p in prompt]

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []  # as LLM.generate
        return self.need_tokenizer("text prompts", "prompt").encode(text, add_special_tokens=True)

    def _logprobs(self, entries: list[tuple[int, float, list[tuple[int, float]]]], offset: int) -> dict:
        """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, lps, tops, offsets = [], [], [], []
        for token_id, lp, top in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            lps.append(max(lp, -9999.0))
            tops.append({self.token_text(t): max(v, -9999.0) for t, v in [(token_id, lp), *top]})
            offsets.append(offset)
            offset += len(text) if self.tokenizer is not None else 0  # no text: "token_id:N" only
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
