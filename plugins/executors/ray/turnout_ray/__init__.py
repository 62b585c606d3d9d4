"""The Ray executor: the same workers as multiproc, placed as Ray actors on one node or several."""

import importlib.util

from turnout import EnvVar, Priority, hookimpl
from turnout.executor import ExecutorContext, ExecutorSpec

RAY_ADDRESS = EnvVar(
    "RAY_ADDRESS", str, "", "the Ray cluster to join (where `ray start --head` ran); unset: start a local one"
)


def _needed(ctx: ExecutorContext) -> bool:
    """Chosen by name, configured through RAY_ADDRESS, or more ranks than this node has GPUs."""
    many = ctx.world_size > 1
    beyond_node = ctx.platform.is_cuda and ctx.world_size > ctx.platform.device_count
    return ctx.explicit or (many and bool(RAY_ADDRESS.value)) or beyond_node


def _check(ctx: ExecutorContext) -> list[str]:
    if importlib.util.find_spec("ray") is None:
        return ["ray is not installed (pip install turnout-ray)"]
    if not _needed(ctx):
        if ctx.world_size == 1:
            return ["world size is 1: uniproc runs it in-process (choose executor=ray to use Ray anyway)"]
        return [
            f"world size {ctx.world_size} fits on this node; multiproc serves it "
            "(choose executor=ray, or set RAY_ADDRESS, to use Ray)"
        ]
    try:
        import ray  # noqa: F401  (importing is the check)
    except Exception as e:  # installed but broken: a reason, not a crash
        return [f"ray does not import ({type(e).__name__}: {e}); reinstall it (pip install turnout-ray)"]
    return []


@hookimpl
def turnout_executors() -> list[ExecutorSpec]:
    target = "turnout_ray.executor:RayExecutor"
    return [ExecutorSpec("ray", target, Priority.SECOND, _check, in_process=False)]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return [RAY_ADDRESS]
