"""The engine core's messages as msgpack, for the sockets between the front and the core's process.

Dataclasses travel as arrays of their fields in order (a CoreBatch's outputs as columns), SamplingParams
as a map of the fields a user sets (the core validates it again on arrival), an error as [class name,
message]. No pickle: a message is data only, and the receiver builds the objects itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from turnout.engine.messages import CoreBatch, EngineInfo, EngineOutput, EngineRequest, SchedulerStats
from turnout.errors import TurnoutError
from turnout.sampling_params import SamplingParams

_PARAM_DEFAULTS = {k: getattr(SamplingParams(), k) for k in SamplingParams.field_names()}


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, strict_map_key=False)  # logit_bias maps token ids


# ---- errors ----
def encode_error(e: BaseException | None) -> list[str] | None:
    return None if e is None else [type(e).__name__, str(e)]


def decode_error(e: list[str] | None) -> TurnoutError | None:
    """The same TurnoutError class where it is one; any other error as a TurnoutError naming it."""
    if e is None:
        return None
    name, message = e
    cls = _error_classes().get(name)
    if cls is None:
        first = message.splitlines()[0] if message else ""
        return TurnoutError(f"{name}: {first}")
    return cls(message)


def _error_classes() -> dict[str, type[TurnoutError]]:
    found, todo = {}, [TurnoutError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


# ---- the front's commands: ("add", [EngineRequest], key), ("abort", [id]), ("drain", t), ("stop",) ----
def encode_command(cmd: tuple) -> bytes:
    if cmd[0] == "add":
        reqs = [(r.req_id, r.prompt_token_ids, encode_params(r.params)) for r in cmd[1]]
        return pack(("add", reqs, cmd[2]))
    return pack(cmd)


def decode_command(data: bytes) -> tuple:
    cmd = unpack(data)
    if cmd[0] == "add":
        return ("add", [EngineRequest(i, ids, SamplingParams(**p)) for i, ids, p in cmd[1]], cmd[2])
    return tuple(cmd)


def encode_params(p: SamplingParams) -> dict[str, Any]:
    """The fields that differ from their defaults; structured_outputs as the dict of its one field."""
    out = {k: v for k, d in _PARAM_DEFAULTS.items() if (v := getattr(p, k)) != d}
    if p.structured_outputs is not None:
        out["structured_outputs"] = p.structured_outputs.as_dict()
    return out


# ---- the core's answers ----
def encode_info(info: EngineInfo) -> list:
    return list(dataclasses.astuple(info))


def decode_info(data: list) -> EngineInfo:
    return EngineInfo(*data)


_PLAIN_REST = (None, None, None, None, 0)  # an output that carries only its token


def _rest(o: EngineOutput) -> tuple:
    return (o.logprobs, o.text, o.finish_reason, o.final_text, o.num_cached_tokens)


def encode_batch(b: CoreBatch) -> bytes:
    """Outputs as columns: every output's req_id and token_id, then [index, the other fields] for only
    those outputs whose other fields are not all defaults (logprobs, text, the last output)."""
    acks = [(key, encode_error(err)) for key, err in b.acks]
    outs = b.outputs
    rare = [[i, *r] for i, o in enumerate(outs) if (r := _rest(o)) != _PLAIN_REST]
    columns = ([o.req_id for o in outs], [o.token_id for o in outs], rare)
    stats = None if b.stats is None else list(vars(b.stats).values())
    return pack((b.time, acks, columns, stats, encode_error(b.fail)))


def decode_batch(data: bytes) -> CoreBatch:
    t, acks, (req_ids, token_ids, rare), stats, fail = unpack(data)
    outputs = [EngineOutput(r, tok, None) for r, tok in zip(req_ids, token_ids)]
    for i, *fields in rare:
        o = outputs[i]
        o.logprobs, o.text, o.finish_reason, o.final_text, o.num_cached_tokens = fields
    return CoreBatch(
        t,
        [(key, decode_error(err)) for key, err in acks],
        outputs,
        None if stats is None else SchedulerStats(*stats),
        decode_error(fail),
    )
