"""Ways into a running LLM for measurement: its host stages by name, each run inside a context manager of
the caller's for a block (a timer, a profiler range, synchronisations), and every rank's memory report.

STAGES is the one map from a stage's name to the methods that run it. A benchmark names stages, never the
attribute paths or private methods behind them; tests/test_bench_profiling.py wraps every stage on a real
engine, so a method that moves or is renamed fails there, not in a benchmark's silent zero.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

from turnout.errors import TurnoutError

# name -> (the part that runs it, its methods); the engine's stages first, then one rank's
STAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "step": ("engine", ("step",)),  # LLMEngine.step: one call of the loop
    "add_request": ("engine", ("add_request",)),
    "launch": ("engine", ("_launch",)),  # hands a scheduled step to the executor
    "read": ("engine", ("_read",)),  # waits for a step's tokens, updates the scheduler
    "detokenize": ("engine", ("_detokenize",)),
    "schedule": ("scheduler", ("schedule",)),
    "update": ("scheduler", ("update",)),
    "execute": ("runner", ("execute_model",)),  # inputs, forward (eager or a graph replay), logits
    "prepare": ("runner", ("prepare",)),  # the step's input tensors and attention metadata
    "fill": ("runner", ("_fill_placeholders",)),  # async scheduling: last step's tokens into the inputs
    "forward": ("runner", ("_forward",)),  # an eager forward; graph replays do not pass here
    "model": ("model", ("forward",)),  # the model module's forward, inside "forward" and graph captures
    "logits": ("model", ("compute_logits",)),
    "attention_metadata": ("builder", ("build",)),  # each KV-cache group's, once a step
    "attention": ("impl", ("forward",)),
    "sample": ("runner", ("sample_tokens", "sample_tokens_async")),
    "sampler": ("sampler", ("forward",)),
    "get": ("output", ("get",)),  # a step's sampled tokens to the host (async: the wait for them)
}
Around = Callable[[str, tuple], AbstractContextManager | None]


def _parts(llm: Any) -> dict[str, Callable[[], type]]:
    """Each part's class, found when asked: the runner's need this LLM's one rank in this process."""
    engine = llm.engine
    if hasattr(engine, "engines"):
        raise TurnoutError(
            f"stages time one engine and this LLM has {len(engine.engines)} data-parallel "
            "replicas; fix: data_parallel_size=1"
        )

    def runner() -> Any:
        worker = getattr(engine.executor, "worker", None)  # an in-process executor holds its one rank
        if worker is None:
            raise TurnoutError(
                f"executor {engine.selection.executor.chosen.name} runs the model in other "
                "processes; fix: executor='uniproc'"
            )
        return worker.runner

    from turnout.worker.outputs import AsyncModelRunnerOutput

    return {
        "engine": lambda: type(engine),
        "scheduler": lambda: type(engine.scheduler),
        "runner": lambda: type(runner()),
        "model": lambda: type(runner().model),
        "builder": lambda: type(runner().builders[0]),
        "impl": lambda: type(runner().impls[0]),
        "sampler": lambda: type(runner().sampler),
        "output": lambda: AsyncModelRunnerOutput,
    }


def _wrap(cls: type, method: str, name: str, around: Around) -> Callable[[], None]:
    """cls.method replaced by one that runs inside around(name, args); returns what puts it back."""
    orig = inspect.getattr_static(cls, method)  # the function, wherever along the MRO it is defined
    own = method in vars(cls)

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        cm = around(name, args)
        if cm is None:
            return orig(self, *args, **kwargs)
        with cm:
            return orig(self, *args, **kwargs)

    run.__name__, run.__doc__ = method, orig.__doc__
    setattr(cls, method, run)
    return lambda: setattr(cls, method, orig) if own else delattr(cls, method)


@contextmanager
def stages(llm: Any, around: Around, names: Iterable[str] | None = None) -> Iterator[None]:
    """While the block runs, each named stage of llm (every one of STAGES by default) runs inside
    around(name, args), args being the call's arguments; around returns a context manager, or None to run
    that call bare. The methods are replaced on their classes, so objects made during the block (each
    step's AsyncModelRunnerOutput) and other engines of this process are covered too; all are put back on
    exit. A rank's stages need it in this process (executor uniproc) and one engine (no data parallelism)."""
    names = list(STAGES if names is None else names)
    if unknown := [n for n in names if n not in STAGES]:
        raise TurnoutError(f"no stage {unknown[0]!r}; the stages are {', '.join(STAGES)}")
    parts, done = _parts(llm), set()
    with ExitStack() as undo:
        for name in names:
            part, methods = STAGES[name]
            cls = parts[part]()
            for method in methods:
                if (cls, method) not in done:
                    done.add((cls, method))
                    undo.callback(_wrap(cls, method, name, around))
        yield


def memory_reports(llm: Any) -> list[dict[str, Any]]:
    """Every rank's memory report, data-parallel replicas in order: weight_bytes (expert_weight_bytes of
    them in MoE experts), kv_cache_bytes, peak_allocated_bytes on CUDA, and each parameter's shape."""
    engines = getattr(llm.engine, "engines", [llm.engine])
    return [r for e in engines for r in e.executor.collective_rpc("memory_report")]
