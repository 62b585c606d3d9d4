"""Data parallelism: data_parallel_size independent LLMEngine replicas behind one front.

Each replica has its own scheduler, KV cache and executor; a new request goes to the replica with the
fewest unfinished requests. The front speaks LLMEngine's request API (add_request, step, abort,
pop_finished), so `LLM` drives it unchanged.

On CUDA replica i owns GPUs [i * world_size, (i + 1) * world_size): its executor's ranks are started while
CUDA_VISIBLE_DEVICES names only those GPUs, so selection admits only executors whose ranks run in processes
of their own (ExecutorSpec.in_process False). On the CPU the replicas may run in this process. Replicas
whose model runs in other processes step in threads, in-process ones one after another (they share the
forward context).

With enable_expert_parallel the replicas' ranks form one process group instead, and a MoE model's experts
are split over all tp x dp of them (`_start_together`); every replica steps while any has work.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from turnout.config import EngineConfig
from turnout.engine.llm_engine import LLMEngine, StepOutput
from turnout.engine.request import Request
from turnout.errors import ConfigError, RequestError
from turnout.executor.rank import free_port
from turnout.platform import current_platform
from turnout.plugins import get_plugin_manager
from turnout.sampling_params import SamplingParams


class DataParallelEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engines: list[LLMEngine] = []
        try:
            if config.expert_parallel_spans_dp:
                self.engines = _start_together(config)
            else:
                for i in range(config.data_parallel_size):
                    with _visible_devices(i, config):
                        self.engines.append(LLMEngine(config))
        except BaseException:
            self.shutdown()
            raise
        first = self.engines[0]
        self.tokenizer, self.tokenizer_problem = first.tokenizer, first.tokenizer_problem
        self.selection, self.info = first.selection, first.info
        self.max_model_len = min(e.max_model_len for e in self.engines)
        threaded = not self.selection.executor_spec.in_process
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

    def need_tokenizer(self, what: str) -> Any:
        """LLMEngine.need_tokenizer of the replicas, which load one tokenizer alike."""
        return self.engines[0].need_tokenizer(what)

    @property
    def requests(self) -> dict[str, Request]:
        """Every replica's live requests by id (ids are unique over the front)."""
        return {k: r for e in self.engines for k, r in e.requests.items()}

    def check_request(
        self, prompt: str | list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """LLMEngine.check_request of the replicas, which share one model and max_model_len."""
        return self.engines[0].check_request(prompt, params)

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

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False)


def _start_together(config: EngineConfig) -> list[LLMEngine]:
    """Replicas that share expert parallelism form one process group: every replica steps when any has
    work (an idle one runs a dummy step), so each must run in worker processes stepped in threads, and they
    start together, as each replica's ranks wait for all the others'. Their ranks see every GPU: global
    rank = device index."""
    n, ws = config.data_parallel_size, config.world_size
    if config.pipeline_parallel_size > 1:
        raise ConfigError(
            "enable_expert_parallel with data_parallel_size > 1 runs without pipeline stages; "
            "set pipeline_parallel_size 1 or unset enable_expert_parallel"
        )
    if config.executor not in ("auto", "multiproc"):
        raise ConfigError(
            f"enable_expert_parallel with data_parallel_size > 1 needs executor=multiproc (or auto), "
            f"not {config.executor}: the replicas share one process group"
        )
    platform = current_platform()
    if platform.is_cuda and n * ws > platform.device_count:
        raise ConfigError(
            f"data_parallel_size {n} x world size {ws} needs {n * ws} GPUs, have {platform.device_count}; "
            "lower data_parallel_size or tensor_parallel_size"
        )
    pinned = {"executor": "multiproc", "data_parallel_master_port": free_port()}
    configs = [config.model_copy(update={**pinned, "data_parallel_rank": i}) for i in range(n)]
    get_plugin_manager()  # loaded once, before the threads that select
    with ThreadPoolExecutor(n, "turnout-dp-start") as pool:
        futures = [pool.submit(LLMEngine, c) for c in configs]
    engines = [f.result() for f in futures if f.exception() is None]
    if len(engines) < n:
        for e in engines:
            e.shutdown()
        raise next(f.exception() for f in futures if f.exception() is not None)
    return engines


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
