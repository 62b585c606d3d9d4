"""The single-process executor: one worker in the engine's own process."""

from turnout import Priority, hookimpl
from turnout.executor import ExecutorContext, ExecutorSpec


def _check(ctx: ExecutorContext) -> list[str]:
    return [] if ctx.world_size == 1 else [f"runs one rank, world size is {ctx.world_size}"]


@hookimpl
def turnout_executors() -> list[ExecutorSpec]:
    return [
        ExecutorSpec(
            "uniproc", "turnout_uniproc.executor:UniprocExecutor", Priority.FIRST, _check,
            supports_async_scheduling=True,
        )
    ]  # fmt: skip
