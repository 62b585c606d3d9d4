"""/v1/explain's body: what selection chose for the served engine and why, the document `turnout explain
--json` prints. The fields the chat page reads are typed; the sections some models add (experts) pass
through."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ExplainCandidate(BaseModel):
    """One plugin's candidate of one kind."""

    name: str
    plugin: str
    priority: int | float
    valid: bool
    reasons: list[str]  # why it cannot serve here; empty where it can
    chosen: bool
    lost: str | None  # why a valid candidate lost to the chosen one


class ExplainKind(BaseModel):
    """Every candidate of one kind (attention, model, executor, graph), the request and the choice."""

    requested: str
    chosen: str
    candidates: list[ExplainCandidate]


class ExplainGraphMode(BaseModel):
    """The graph mode as requested and as it runs, and why a downgrade happened."""

    requested: str
    effective: str
    reason: str | None


class ExplainSetting(BaseModel):
    """An engine setting's value and its source: default, file, env, flag, or fitted: <why>."""

    value: Any
    source: str


class ExplainResponse(BaseModel):
    """What selection chose for the served engine and why."""

    model_config = ConfigDict(extra="allow")

    platform: str
    model: str
    architecture: str
    dtype: str
    kinds: dict[str, ExplainKind]
    graph_mode: ExplainGraphMode
    settings: dict[str, ExplainSetting]
    attention_phases: dict[str, str] | None  # per-phase attention: phase -> backend
    attention_note: str | None
    measured: dict[str, Any] | None  # the tuning record read, its figures and decision
