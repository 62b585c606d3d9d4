"""The engine core's messages: what the front sends it (EngineRequest), what it hands back once per step
(CoreBatch: acks, one EngineOutput per new token, SchedulerStats), what the front learns of a started
engine (EngineInfo), and the errors that end the front's requests. Plain data, whether they travel through
a queue or as msgpack (turnout.engine.serial)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnout.errors import TurnoutError
from turnout.sampling_params import SamplingParams


class EngineDeadError(TurnoutError):
    """The engine core stopped on an error; every request fails until the server restarts."""


class EngineBusyError(TurnoutError):
    """The waiting queue is full, or the server is shutting down; the request was not run (or not run to
    its end)."""


class EngineShutdownError(EngineBusyError):
    """The server is shutting down: it takes no new request, and ends those still running at the drain's
    deadline."""


@dataclass
class EngineRequest:
    """A request for the core: its id, prompt tokens and sampling parameters."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class EngineOutput:
    """One request's news from one step: one new token."""

    req_id: str
    token_id: int
    logprobs: tuple[float, list[tuple[int, float]]] | None  # chosen token's and the top N, when asked
    text: str | None = None  # the engine's text delta where it detokenizes (stop strings), else None
    finish_reason: str | None = None  # "stop" or "length" on a request's last output
    final_text: str | None = None  # the request's whole text, on its last output
    num_cached_tokens: int = 0  # prefix-cache hits, on the last output


@dataclass
class SchedulerStats:
    """The scheduler's gauges and counters after a step, summed over data-parallel replicas."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # share of KV blocks held by requests
    prefix_cache_queries: int = 0  # prompt tokens looked up, since start
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # since start


@dataclass
class CoreBatch:
    """What the core hands back once a step: an ack per group of requests added (its key, and the error that
    refused it or None), the step's outputs, the scheduler's stats, and an error that ends every request."""

    time: float
    acks: list[tuple[int, TurnoutError | None]]
    outputs: list[EngineOutput]
    stats: SchedulerStats | None
    fail: TurnoutError | None = None  # every request the front holds ends with this error


@dataclass
class EngineInfo:
    """What the front needs of a started engine: its context limit, the selection's names, and why it has
    no tokenizer ("" where it has one)."""

    max_model_len: int
    model: str  # the HF-style folder loaded (its tokenizer is the front's)
    architecture: str
    backend: str
    executor: str
    graph_mode: str
    tokenizer_problem: str

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        """The info of a started LLMEngine (or its data-parallel front)."""
        sel = engine.selection
        return cls(
            engine.max_model_len, str(sel.model_info.path), sel.model_info.architecture,
            sel.attention.chosen.name, sel.executor.chosen.name, sel.effective_graph.name,
            engine.tokenizer_problem,
        )  # fmt: skip
