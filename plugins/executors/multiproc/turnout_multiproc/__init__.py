"""The multi-process executor: one worker process per rank on this node."""

from turnout import EnvVar, Priority, hookimpl
from turnout.executor import ExecutorContext, ExecutorSpec
from turnout_multiproc.envs import ENV_VARS


def _check(ctx: ExecutorContext) -> list[str]:
    if ctx.world_size == 1 and not (ctx.explicit or ctx.own_processes):
        return ["world size is 1: uniproc runs it in-process (pass executor=multiproc to force a worker)"]
    have = ctx.platform.device_count
    if ctx.platform.is_cuda and ctx.world_size > have:
        return [f"needs {ctx.world_size} GPUs on this node, have {have}; use executor=ray for several nodes"]
    return []


@hookimpl
def turnout_executors() -> list[ExecutorSpec]:
    target = "turnout_multiproc.executor:MultiprocExecutor"
    return [ExecutorSpec("multiproc", target, Priority.THIRD, _check, in_process=False)]


@hookimpl
def turnout_env_vars() -> list[EnvVar]:
    return ENV_VARS
