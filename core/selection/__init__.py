"""Selection, devpi/conda style: ask every plugin, collect every candidate, pick in the core, and keep the
reason for every rejection so `turnout explain` can show it.

select_all (pipeline) runs the steps in order: apply_records (the tuning records, once), then one selector
per kind, each a function of its inputs that returns the kind's Choice: select_moe, select_quantization,
select_model, select_attention, select_executor, select_graph; then effective_graph, the fitted settings
and resolve_async_scheduling. The modules, one per step:

- choice: Candidate, Choice, Loss, ranked and choose, the rule every kind follows; plugin_candidates;
- order: attention_order, that rule per platform and phase, as `turnout plugins --order` prints it;
- measured: the measured tier (tuning records, read, never the tuner);
- attention, model, executor, graph, moe, quantization: each kind's candidates and selector;
- result: Selection, what the steps add up to;
- pipeline: select_all, and handing a Selection to worker processes.
"""

from turnout.selection.attention import (
    attention_candidates,
    attention_context,
    choose_attention,
    select_attention,
)
from turnout.selection.choice import (
    CONFIG_KEYS,
    KIND_LABELS,
    PHASES,
    Candidate,
    Choice,
    Loss,
    choose,
    plugin_candidates,
    ranked,
)
from turnout.selection.executor import (
    OWN_PROCESSES,
    executor_candidates,
    resolve_async_scheduling,
    select_executor,
)
from turnout.selection.graph import effective_graph, graph_candidates, select_graph
from turnout.selection.measured import MeasuredTier, apply_records, measured_tier
from turnout.selection.model import model_candidates, select_model
from turnout.selection.moe import expert_placement, moe_candidates, select_moe
from turnout.selection.order import REFERENCE_PLATFORMS, PhaseOrder, attention_order
from turnout.selection.pipeline import select_all, selection_from_payload, worker_handoff
from turnout.selection.quantization import quantization_context, select_quantization
from turnout.selection.result import Selection

__all__ = [
    "CONFIG_KEYS",
    "KIND_LABELS",
    "OWN_PROCESSES",
    "PHASES",
    "REFERENCE_PLATFORMS",
    "Candidate",
    "Choice",
    "Loss",
    "MeasuredTier",
    "PhaseOrder",
    "Selection",
    "apply_records",
    "attention_candidates",
    "attention_order",
    "attention_context",
    "choose",
    "choose_attention",
    "effective_graph",
    "executor_candidates",
    "expert_placement",
    "graph_candidates",
    "measured_tier",
    "model_candidates",
    "moe_candidates",
    "plugin_candidates",
    "quantization_context",
    "ranked",
    "resolve_async_scheduling",
    "select_all",
    "select_attention",
    "select_executor",
    "select_graph",
    "select_model",
    "select_moe",
    "select_quantization",
    "selection_from_payload",
    "worker_handoff",
]
