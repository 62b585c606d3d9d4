"""What /v1/completions and /v1/chat/completions share: the model check, SamplingParams from a request,
the engine requests of one HTTP request, a choice's text and logprobs as its tokens arrive, SSE."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from turnout.engine.async_llm import AsyncLLM
from turnout.engine.detokenizer import Detokenizer
from turnout.engine.messages import (
    EngineBusyError,
    EngineDeadError,
    EngineOutput,
    EngineRequest,
    EngineShutdownError,
)
from turnout.entrypoints.openai.protocol import OpenAIError
from turnout.errors import RequestError, TurnoutError
from turnout.prompts import context_problem
from turnout.sampling_params import SamplingParams
from turnout.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def engine_error(e: TurnoutError) -> OpenAIError:
    """The HTTP answer to an error the engine raised for a request."""
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), "service_unavailable_error", code="engine_dead")
    if isinstance(e, EngineShutdownError):
        return OpenAIError(503, str(e), "service_unavailable_error", code="server_shutting_down")
    if isinstance(e, EngineBusyError):
        return OpenAIError(503, str(e), "service_unavailable_error", code="server_busy")
    return OpenAIError(400, str(e), param=_param_of(str(e)))


def _param_of(message: str) -> str | None:
    """The request field a validation message is about: the SamplingParams field it names first."""
    hits = [(m.start(), f) for f in _PARAM_FIELDS if (m := re.search(rf"\b{f}\b", message))]
    return min(hits)[1] if hits else ("prompt" if "prompt" in message else None)


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The constraint of response_format (json_object, json_schema) or vLLM's structured_outputs field."""
    fmt, so = req.response_format, req.structured_outputs
    if so is not None:
        if fmt is not None and fmt.type != "text":
            raise OpenAIError(
                400, "response_format and structured_outputs both constrain the output; send one",
                param="structured_outputs",
            )  # fmt: skip
        return StructuredOutputsParams(**so.model_dump(by_alias=True, exclude_none=True))
    if fmt is None or fmt.type == "text":
        return None
    schema = fmt.json_schema.schema_ if fmt.type == "json_schema" else None
    return (
        StructuredOutputsParams(json=schema)
        if schema is not None
        else StructuredOutputsParams(json_object=True)
    )


class Choice:
    """One completion's state as its tokens arrive: token ids, its text, how much of it was sent, logprobs.

    With stop strings the last (longest stop - 1) characters are held back until the next token: they
    may be the start of a stop string, which the engine cuts from the text when it completes."""

    def __init__(self, index: int, prompt_len: int, stop: list[str], detok: Detokenizer | None) -> None:
        self.index, self.prompt_len, self.detok = index, prompt_len, detok
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # (token, logprob, top N)
        self.finish_reason: str | None = None

    def advance(self, outs: list[EngineOutput]) -> str:
        """Take this choice's new outputs, in order; return the text they let out."""
        for o in outs:
            self.token_ids.append(o.token_id)
            if o.logprobs is not None:
                self.logprobs.append((o.token_id, *o.logprobs))
        last = outs[-1]
        if last.final_text is not None:  # the engine's text is the truth
            self.text, self.finish_reason, upto = last.final_text, last.finish_reason, len(last.final_text)
        else:
            if last.text is not None:
                self.text += "".join(o.text or "" for o in outs)
            elif self.detok is not None:
                self.text += self.detok.step(self.token_ids)
            upto = len(self.text) - self.holdback
        delta = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str]) -> None:
        self.engine, self.model_names = engine, model_names
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}

    def need_tokenizer(self, what: str, param: str) -> Any:
        """The server's tokenizer, or a 400 about `param`: `what` needs one, why there is none, the fix."""
        try:
            return self.engine.need_tokenizer(what)
        except RequestError as e:
            raise OpenAIError(400, str(e), param=param) from None

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.model_names:
            raise OpenAIError(
                404,
                f"model '{name}' is not served here; this server serves {', '.join(self.model_names)}",
                "not_found_error",
                "model",
                "model_not_found",
            )
        return name or self.model_names[0]

    def sampling_params(
        self,
        req: Any,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; `structured` (a tool_choice's constraint) stands in for the
        request's own response_format / structured_outputs."""
        if req.logit_bias:
            raise OpenAIError(400, "logit_bias is not supported; leave it out", param="logit_bias")
        if req.stream_options is not None and not req.stream:
            raise OpenAIError(400, "stream_options needs stream: true", param="stream_options")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise OpenAIError(
                400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs"
            )
        kw = dict(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
        )
        try:
            kw["structured_outputs"] = structured or structured_outputs(req)
            return SamplingParams(**{k: v for k, v in kw.items() if v is not None})
        except (ValueError, TurnoutError) as e:
            raise OpenAIError(400, str(e), param=_param_of(str(e))) from None

    def check_length(self, prompt_ids: list[int], max_tokens: int, param: str) -> None:
        limit = self.engine.max_model_len
        if not prompt_ids:
            raise OpenAIError(400, f"{param} is empty; send at least one token", param=param)
        if (problem := context_problem(len(prompt_ids), max_tokens, limit)) is not None:
            raise OpenAIError(413, problem, param=param, code="context_length_exceeded")

    def requests(
        self, rid: str, prompts: list[list[int]], params: list[SamplingParams], stream: bool
    ) -> tuple[list[EngineRequest], dict[str, Choice]]:
        """n engine requests per prompt (seeds seed, seed+1, ...); choice index = prompt index * n + k."""
        reqs, choices = [], {}
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            for k in range(sp.n):
                index = i * sp.n + k
                seed = None if sp.seed is None else sp.seed + k
                req = EngineRequest(f"{rid}-{index}", ids, dataclasses.replace(sp, n=1, seed=seed))
                reqs.append(req)
                detok = Detokenizer(self.tokenizer) if stream and not sp.stop else None
                choices[req.req_id] = Choice(index, len(ids), sp.stop, detok)
        return reqs, choices

    async def run(self, reqs: list[EngineRequest], stream: bool) -> Any:
        try:
            return await self.engine.generate(reqs, per_token=stream)
        except TurnoutError as e:
            raise engine_error(e) from None

    async def collect(self, outputs: Any, choices: dict[str, Choice]) -> None:
        try:
            with outputs:
                async for batch in outputs:
                    for req_id, outs in _by_request(batch):
                        choices[req_id].advance(outs)
        except TurnoutError as e:
            raise engine_error(e) from None

    async def sse_stream(
        self,
        outputs: Any,
        choices: dict[str, Choice],
        chunk: Callable[[Choice, str, int, str | None], dict[str, Any] | None],
        head: list[dict[str, Any]],
        usage_base: dict[str, Any] | None,
        n_prompt: int,
    ) -> AsyncIterator[str]:
        """head chunks; then per choice, for what arrived since the last chunk, one chunk that adds
        text or logprobs or ends the choice: chunk(choice, text, new logprobs, finish_reason), or None where
        it has nothing to send yet; with a usage_base (stream_options.include_usage), a last chunk of no
        choices and the usage; [DONE]. An engine error becomes an error event before [DONE]."""
        try:
            with outputs:
                for h in head:
                    yield sse(h)
                async for batch in outputs:
                    events = []
                    for req_id, outs in _by_request(batch):
                        c = choices[req_id]
                        delta = c.advance(outs)
                        k = sum(o.logprobs is not None for o in outs)
                        if delta or k or outs[-1].finish_reason:
                            if (ev := chunk(c, delta, k, outs[-1].finish_reason)) is not None:
                                events.append(sse(ev))
                    if events:
                        yield "".join(events)  # one write for the batch
            if usage_base is not None:
                yield sse({**usage_base, "choices": [], "usage": usage(n_prompt, completion_tokens(choices))})
        except TurnoutError as e:
            yield sse(engine_error(e).body())
        yield "data: [DONE]\n\n"

    def token_text(self, token_id: int) -> str:
        """A token's text; without a tokenizer "token_id:N", as vLLM's --return-tokens-as-token-ids."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        if (s := self._token_text.get(token_id)) is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return s


def _by_request(batch: list[EngineOutput]) -> list[tuple[str, list[EngineOutput]]]:
    by: dict[str, list[EngineOutput]] = {}
    for o in batch:
        by.setdefault(o.req_id, []).append(o)
    return list(by.items())


def completion_tokens(choices: dict[str, Choice]) -> int:
    return sum(len(c.token_ids) for c in choices.values())
