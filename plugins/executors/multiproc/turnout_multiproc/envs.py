"""The multiproc executor's switches, declared to the core through turnout_env_vars."""

from turnout import EnvVar


def seconds(text: str) -> float:
    """A positive number of seconds."""
    s = float(text)
    if not s > 0:
        raise ValueError("want a positive number of seconds")
    return s


HEARTBEAT_MISSES = 5  # beats in a row a rank may miss before it counts as hung
HEARTBEAT_INTERVAL = EnvVar(
    "TURNOUT_MULTIPROC_HEARTBEAT_INTERVAL_S",
    seconds,
    1.0,
    f"seconds between two heartbeats of a worker (sent from a thread of its own, so a long step sends them "
    f"too); a worker that misses {HEARTBEAT_MISSES} in a row is hung, and the engine stops naming its rank",
)
ENV_VARS = [HEARTBEAT_INTERVAL]
