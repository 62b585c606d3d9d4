"""Data parallelism: data_parallel_size independent LLMEngine replicas behind one front.

Each replica has its own scheduler, KV cache and executor; a new request goes to the replica with the
fewest unfinished requests. The front speaks LLMEngine's request API (add_request, step, abort,
pop_finished), so `LLM` drives it unchanged.

On CUDA replica i owns GPUs [i * world_size, (i + 1) * world_size): its executor must start its own
processes (multiproc), which are spawned while CUDA_VISIBLE_DEVICES names only those GPUs. On the CPU the
replicas may run in this process (uniproc). Replicas whose model runs in other processes step in threads,
in-process ones one after another (they share the forward context).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from turnout.config import EngineConfig
from turnout.engine.llm_engine import LLMEngine, StepOutput
from turnout.engine.request import Request
from turnout.errors import ConfigError, RequestError
from turnout.outputs import CompletionOutput, RequestOutput
from turnout.platform import current_platform
from turnout.sampling_params import SamplingParams


class DataParallelEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engines: list[LLMEngine] = []
        try:
            for i in range(config.data_parallel_size):
                with _visible_devices(i, config):
                    self.engines.append(LLMEngine(_replica_config(config)))
        except BaseException:
            self.shutdown()
            raise
        first = self.engines[0]
        self.tokenizer, self.selection, self.info = first.tokenizer, first.selection, first.info
        self.max_model_len = min(e.max_model_len for e in self.engines)
        threaded = all(not getattr(e.executor, "in_process", True) for e in self.engines)
        self._pool = ThreadPoolExecutor(len(self.engines), "turnout-dp") if threaded else None
        self._owner: dict[str, LLMEngine] = {}
        self._ids = itertools.count()

    # ---- requests ----
    def load(self, engine: LLMEngine) -> int:
        return len(engine.scheduler.waiting) + len(engine.scheduler.running)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, req_id: str | None = None
    ) -> Request:
        req_id = req_id or str(next(self._ids))
        if req_id in self._owner:
            raise RequestError(f"request id {req_id} is already in use; pick another")
        engine = min(self.engines, key=self.load)
        req = engine.add_request(prompt, params, req_id)
        self._owner[req_id] = engine
        return req

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engines[0].tokenize(prompt)

    def abort(self, req_id: str) -> None:
        if (engine := self._owner.get(req_id)) is not None:
            engine.abort(req_id)

    def abort_request(self, req_id: str) -> None:
        if (engine := self._owner.pop(req_id, None)) is not None:
            engine.abort_request(req_id)

    def pop_finished(self, req_id: str) -> tuple[Request, str]:
        return self._owner.pop(req_id).pop_finished(req_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    # ---- the loop ----
    def step(self) -> list[StepOutput]:
        try:
            if self._pool is not None:
                steps = list(self._pool.map(LLMEngine.step, self.engines))
            else:
                steps = [e.step() for e in self.engines]
        except BaseException:
            self.shutdown()  # a replica whose worker died leaves the front unusable
            raise
        return [s for outs in steps for s in outs]

    def generate(
        self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """One completion per prompt (params.n is not expanded), in prompt order; LLM.generate does more."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        pending = {r.req_id for r in reqs}
        while pending:
            pending -= {s.req.req_id for s in self.step() if s.finished}
        outs = []
        for i, (prompt, r) in enumerate(zip(prompts, reqs)):
            req, text = self.pop_finished(r.req_id)
            text_prompt = prompt if isinstance(prompt, str) else None
            done = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason)
            outs.append(RequestOutput(str(i), text_prompt, req.prompt_token_ids, [done]))
        return outs

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)


def _replica_config(config: EngineConfig) -> EngineConfig:
    """On CUDA a replica's ranks must live in their own processes, so each sees only its GPUs."""
    if not current_platform().is_cuda:
        return config
    if config.executor == "uniproc":
        raise ConfigError(
            "data_parallel_size > 1 on CUDA needs workers in their own processes; "
            "use executor=multiproc (or auto), not uniproc"
        )
    return config if config.executor != "auto" else config.model_copy(update={"executor": "multiproc"})


@contextmanager
def _visible_devices(replica: int, config: EngineConfig) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES = this replica's GPUs while its worker processes are spawned."""
    platform = current_platform()
    if not platform.is_cuda:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = old.split(",") if old else [str(i) for i in range(platform.device_count)]
    n, ws = config.data_parallel_size, config.world_size
    if n * ws > len(visible):
        raise ConfigError(
            f"data_parallel_size {n} x world size {ws} needs {n * ws} GPUs, have {len(visible)}; "
            "lower data_parallel_size or tensor_parallel_size"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[replica * ws : (replica + 1) * ws])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
