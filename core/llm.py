"""The Python API: LLM(...).generate(prompts, sampling_params)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from turnout.config import EngineConfig
from turnout.engine.llm_engine import LLMEngine
from turnout.errors import RequestError
from turnout.outputs import CompletionOutput, RequestOutput
from turnout.sampling_params import SamplingParams
from turnout.selection import Selection

logger = logging.getLogger("turnout")
Prompt = str | list[int]


class LLM:
    """LLM(model=None, config=None, **overrides). No model = the embedded SmolLM2-135M-Instruct.
    `config` is an EngineConfig or a path to a TOML/YAML file; overrides are EngineConfig fields."""

    def __init__(
        self, model: str | None = None, config: EngineConfig | str | Path | None = None, **overrides: Any
    ):
        if isinstance(config, EngineConfig):
            cfg = config.model_copy(
                update={k: v for k, v in {"model": model, **overrides}.items() if v is not None}
            )
            cfg = EngineConfig(**cfg.model_dump())  # re-validate the merged values
        else:
            cfg = EngineConfig.load(config, model=model, **overrides)
        self.config = cfg
        if cfg.data_parallel_size > 1:  # replicas behind one front that speaks LLMEngine's request API
            from turnout.engine.dp import DataParallelEngine

            self.engine = DataParallelEngine(cfg)
        else:
            self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer
        logger.info("selected %s", self.engine.selection.summary())

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A bad prompt gets an output with .error set and
        no tokens; the other prompts run as if it were not there."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(params_list)} sampling params; pass one or one each"
            )
        results = [
            RequestOutput(str(i), p if isinstance(p, str) else None, []) for i, p in enumerate(prompts)
        ]
        pending: dict[str, tuple[int, int]] = {}  # engine req id -> (prompt index, sample index)
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
                self._add(i, prompt, sp, results[i], pending)
            self._run(pending, results, use_tqdm)
        finally:
            for req_id in pending:  # interrupted: leave the engine clean
                self.engine.abort(req_id)
                self.engine.pop_finished(req_id)
        return results

    def _add(self, i: int, prompt: Prompt, sp: SamplingParams, result: RequestOutput, pending: dict) -> None:
        added = []
        try:
            for k in range(sp.n):
                seed = None if sp.seed is None else sp.seed + k
                req = self.engine.add_request(prompt, dataclasses.replace(sp, n=1, seed=seed))
                added.append(req.req_id)
                pending[req.req_id] = (i, k)
            result.prompt_token_ids = req.prompt_token_ids
        except RequestError as e:
            for req_id in added:
                self.engine.abort(req_id)
                self.engine.pop_finished(req_id)
                pending.pop(req_id)
            result.error = str(e)
            logger.error("request %d rejected: %s", i, e)

    def _run(self, pending: dict[str, tuple[int, int]], results: list[RequestOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(pending), desc="generate", unit="req", disable=not use_tqdm or len(pending) < 2)
        while pending:
            for s in self.engine.step():
                if s.finished and s.req.req_id in pending:
                    i, k = pending.pop(s.req.req_id)
                    req, text = self.engine.pop_finished(s.req.req_id)
                    results[i].outputs.append(_completion(k, req, text))
                    results[i].num_cached_tokens = max(results[i].num_cached_tokens, req.num_cached_tokens)
                    bar.update(1)
        bar.close()
        for r in results:
            r.outputs.sort(key=lambda c: c.index)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as it is generated, for one prompt."""
        req = self.engine.add_request(prompt, dataclasses.replace(sampling_params or SamplingParams(), n=1))
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

    @property
    def selection(self) -> Selection:
        return self.engine.selection

    def shutdown(self) -> None:
        self.engine.shutdown()


def _completion(index: int, req: Any, text: str) -> CompletionOutput:
    lp = req.logprobs if req.params.logprobs is not None else None
    top = req.top_logprobs if req.params.logprobs is not None else None
    return CompletionOutput(index, text, list(req.output_token_ids), req.finish_reason, lp, top)
