"""The Python API, in vLLM's shape: LLM(...).generate(prompts, sampling_params) and .chat(messages, ...)."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from turnout import envs
from turnout.config import EngineConfig
from turnout.engine.core import make_engine
from turnout.engine.request import Request, TokenLogprobs
from turnout.errors import RequestError
from turnout.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from turnout.prompts import (
    Conversation,
    ParsedPrompt,
    Prompt,
    as_prompt_list,
    check_conversation,
    parse_prompt,
)
from turnout.sampling_params import SEED_LIMIT, SamplingParams, allow_logprobs
from turnout.selection import Selection

logger = logging.getLogger("turnout")
OnOutput = Callable[[int, RequestOutput], None]


class LLM:
    """LLM(model=None, config=None, **overrides). No model = the embedded SmolLM2-135M-Instruct; a model is
    an HF-style folder or a .gguf file (converted once into a cached folder). `config` is an EngineConfig
    or a path to a TOML/YAML file; overrides are EngineConfig fields."""

    def __init__(
        self, model: str | None = None, config: EngineConfig | str | Path | None = None, **overrides: Any
    ):
        if isinstance(config, EngineConfig):
            given = {k: v for k, v in {"model": model, **overrides}.items() if v is not None}
            cfg = EngineConfig(**config.model_copy(update=given).model_dump())  # re-validate the merge
            cfg.with_sources({**config._sources, **dict.fromkeys(given, "argument")})
        else:
            cfg = EngineConfig.load(config, model=model, **overrides)
        self.config = cfg
        log_to_stderr()
        if cfg.tune == "auto":  # where no record matches, measure first: the engine below reads the record
            from turnout.tuning.tuner import tune_if_unseen

            tune_if_unseen(cfg)
        self.engine = make_engine(cfg)
        allow_logprobs(cfg.max_logprobs)
        self.tokenizer = self.engine.tokenizer
        logger.info("selected %s", self.engine.selection.summary())
        self.request_counter = itertools.count()  # request ids are unique over this LLM's life
        self._token_text: dict[int, str] = {}

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer; None where it loaded none (skip_tokenizer_init, or a model folder
        without tokenizer files)."""
        return self.tokenizer

    # ---- prompts ----
    def apply_chat_template(
        self, messages: Conversation, chat_template: str | None = None, add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's chat template writes it; RequestError if it is malformed."""
        check_conversation(messages)
        tokenizer = self.engine.need_tokenizer("chat conversations")
        try:
            return tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # the template is the model's code (jinja): any failure is this request's
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RequestError(f"the chat template cannot render this conversation: {first}") from None

    def chat_prompt(self, messages: Conversation, **template: Any) -> ParsedPrompt:
        """(text, token ids) of a conversation: the template writes the special tokens, so none are added."""
        text = self.apply_chat_template(messages, **template)
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation ----
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        on_output: OnOutput | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A bad prompt (malformed, too long for
        max_model_len with its max_tokens, ...) raises ValueError naming its index before anything runs,
        as vLLM does. on_output(i, output), if given, is called as each prompt finishes."""
        parsed: list[ParsedPrompt | RequestError] = []
        for p in as_prompt_list(prompts):
            try:
                parsed.append(parse_prompt(p))
            except RequestError as e:
                parsed.append(e)
        return self._generate(parsed, sampling_params, use_tqdm, "prompt", on_output)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a list of them,
        each written by the tokenizer's chat template (or chat_template). One RequestOutput each; a bad
        conversation raises ValueError naming its index before anything runs."""
        if not isinstance(messages, (list, tuple)):
            raise RequestError(
                f"messages must be a list of messages or of conversations, got {type(messages).__name__}"
            )
        one = not messages or not isinstance(messages[0], (list, tuple))
        parsed: list[ParsedPrompt | RequestError] = []
        for conv in [messages] if one else messages:
            try:
                parsed.append(
                    self.chat_prompt(
                        list(conv), chat_template=chat_template, add_generation_prompt=add_generation_prompt
                    )
                )  # type: ignore[arg-type]
            except RequestError as e:
                parsed.append(e)
        return self._generate(parsed, sampling_params, use_tqdm, "conversation", None)

    def _generate(
        self,
        prompts: list[ParsedPrompt | RequestError],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        noun: str,
        on_output: OnOutput | None,
    ) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(
                f"got {len(prompts)} prompts but {len(params_list)} sampling params; pass one or one each"
            )
        token_ids = [self._check(i, p, sp, noun) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        results = [RequestOutput(str(next(self.request_counter)), None, []) for _ in prompts]
        pending: dict[str, tuple[int, int]] = {}  # engine req id -> (prompt index, sample index)
        try:
            for i, (prompt, ids, sp) in enumerate(zip(prompts, token_ids, params_list)):
                results[i].prompt = prompt[0]  # type: ignore[index]
                self._add(i, ids, sp, results[i], pending)
            self._run(pending, results, params_list, use_tqdm, on_output)
        finally:
            for req_id in pending:  # interrupted: leave the engine clean
                self.engine.abort(req_id)
                self.engine.pop_finished(req_id)
        return results

    def _check(self, i: int, prompt: ParsedPrompt | RequestError, sp: Any, noun: str) -> list[int]:
        """The prompt's token ids, or RequestError naming prompt i and what to change."""
        try:
            if isinstance(prompt, RequestError):
                raise prompt
            if not isinstance(sp, SamplingParams):
                raise RequestError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
            return self.engine.check_request(prompt[1], sp)[0]
        except RequestError as e:
            raise RequestError(f"{noun} {i}: {e}") from None

    def _add(
        self, i: int, prompt: list[int], sp: SamplingParams, result: RequestOutput, pending: dict
    ) -> None:
        """best_of (else n) engine requests, seeds seed, seed + 1, ...; ranking best_of needs each one's
        chosen-token logprobs, so those are asked for even where the caller did not."""
        num = sp.best_of or sp.n
        logprobs = 0 if sp.logprobs is None and num > sp.n else sp.logprobs
        for k in range(num):
            seed = None if sp.seed is None else (sp.seed + k) % SEED_LIMIT
            sub = dataclasses.replace(
                sp,
                n=1,
                best_of=None,
                seed=seed,
                logprobs=logprobs,
                prompt_logprobs=sp.prompt_logprobs if k == 0 else None,
            )
            req = self.engine.add_request(prompt, sub, f"{result.request_id}-{k}")
            pending[req.req_id] = (i, k)
        result.prompt_token_ids = req.prompt_token_ids

    def _run(
        self,
        pending: dict[str, tuple[int, int]],
        results: list[RequestOutput],
        params: list[SamplingParams],
        use_tqdm: bool,
        on_output: OnOutput | None,
    ) -> None:
        """Step until every request is done. Progress: tokens generated, counted to what will run: each
        request's max_tokens (which fits the context), less what a request that ends early leaves unused."""
        left = collections.Counter(i for i, _ in pending.values())
        reqs = [self.engine.requests[r] for r in pending]
        bar = tqdm(
            total=sum(r.params.max_tokens for r in reqs), desc="generate", unit="tok", disable=not use_tqdm
        )
        while pending:
            for s in self.engine.step():
                if s.finished and s.req.req_id in pending:
                    i, k = pending.pop(s.req.req_id)
                    req, text = self.engine.pop_finished(s.req.req_id)
                    results[i].outputs.append(self._completion(k, req, text))
                    results[i].num_cached_tokens = max(results[i].num_cached_tokens, req.num_cached_tokens)
                    if req.params.prompt_logprobs is not None:
                        results[i].prompt_logprobs = [
                            None,
                            *self._logprobs(req.prompt_token_ids[1:], req.prompt_logprobs),
                        ]
                    bar.total -= req.params.max_tokens - len(req.output_token_ids)
                    left[i] -= 1
                    if not left[i]:
                        self._finish(i, results[i], params[i], on_output)
            if not bar.disable:
                bar.update(sum(len(r.output_token_ids) for r in reqs) - bar.n)
        bar.close()

    @staticmethod
    def _finish(i: int, result: RequestOutput, sp: SamplingParams, on_output: OnOutput | None) -> None:
        result.outputs.sort(key=lambda c: c.index)
        _keep_best(result, sp)
        if on_output is not None:
            on_output(i, result)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as it is generated, for one prompt."""
        _, engine_prompt = parse_prompt(prompt)
        sp = dataclasses.replace(sampling_params or SamplingParams(), n=1, best_of=None)
        req = self.engine.add_request(engine_prompt, sp, f"{next(self.request_counter)}-0")
        req.stream = True
        try:
            while True:
                for s in self.engine.step():
                    if s.req is req:
                        if s.delta:
                            yield s.delta
                        if s.finished:
                            return
        finally:
            self.engine.abort(req.req_id)
            self.engine.pop_finished(req.req_id)

    # ---- outputs ----
    def _completion(self, index: int, req: Request, text: str) -> CompletionOutput:
        asked = req.params.logprobs is not None
        return CompletionOutput(
            index,
            text,
            list(req.output_token_ids),
            req.finish_reason,
            req.stop_reason,
            req.cumulative_logprob if asked else None,
            self._logprobs(req.output_token_ids, req.logprobs) if asked else None,
        )

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprobs]) -> SampleLogprobs:
        """vLLM's shape: per position {token id: Logprob}, the chosen token first, then the top N."""
        out = []
        for tok, (lp, rank, top) in zip(token_ids, entries):
            d = {tok: Logprob(lp, rank, self._text_of(tok))}
            d.update({t: Logprob(v, r, self._text_of(t)) for r, (t, v) in enumerate(top, 1)})
            out.append(d)
        return out

    def _text_of(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        if (text := self._token_text.get(token_id)) is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    @property
    def selection(self) -> Selection:
        """What was chosen at start-up and why: each component's Choice, and the chosen objects."""
        return self.engine.selection

    def shutdown(self) -> None:
        """Stop the executor and its workers; the LLM takes no requests afterwards."""
        self.engine.shutdown()


class _StderrHandler(logging.StreamHandler):
    """turnout's own lines on stderr while the application configures no logging: it stays silent once
    the root logger has a handler (logging.basicConfig, pytest), which then gets them instead."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.root.handlers:
            super().emit(record)


def log_to_stderr() -> None:
    """As vLLM does, show turnout's INFO lines (selection, model loaded, KV cache) in a script that set up
    no logging: a stderr handler on the "turnout" logger, at TURNOUT_LOG_LEVEL. Where logging is set up
    (the root logger has a handler, or the "turnout" logger a level or handler) nothing changes."""
    if logging.root.handlers or logger.handlers or logger.level != logging.NOTSET:
        return
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(envs.LOG_LEVEL.value)


def _keep_best(result: RequestOutput, sp: SamplingParams) -> None:
    """best_of > n: the n completions with the highest cumulative logprob, re-indexed."""
    if (sp.best_of or sp.n) <= sp.n:
        return
    best = sorted(result.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[: sp.n]
    for j, c in enumerate(best):
        c.index = j
        if sp.logprobs is None:
            c.logprobs = None
    result.outputs = best
