"""Attention per phase: decode steps to one backend, the other steps to another, one KV cache."""

from __future__ import annotations

import types

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.attention import AttentionMetadata, AttentionSpec, CudagraphSupport
from turnout.attention.per_phase import PerPhaseBackend, phase_support
from turnout.config import EngineConfig
from turnout.errors import ConfigError, SelectionError
from turnout.models.info import ModelInfo
from turnout.selection import select_all

from fake_dist import naive_backend_source

PERMUTED = """
class BlocksFirst(NaiveBackend):
    name = "blocks_first"

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size, kv_lora_rank=None):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [NaiveBackend(), BlocksFirst()]
"""


@pytest.fixture
def naive(register_plugin):
    """The example third-party backend, and a copy of it that lays its KV cache out blocks first."""
    source = naive_backend_source().split("@turnout.hookimpl")[0] + PERMUTED
    mod = types.ModuleType("inproc_naive_phases")
    exec(compile(source, "inproc_naive_phases", "exec"), mod.__dict__)
    register_plugin(mod, "naive_plugin")


def _tokens(
    model, backend: str, prompts: list[list[int]], together: list[list[int]]
) -> tuple[list[list[int]], int]:
    # 32-token steps chunk the 70-token prompts; the shared 48-token head hits the prefix cache. One at a
    # time, the later prompts find the earlier ones' blocks cached; together (new prompts), a request
    # decodes beside the next one's prefill chunks (mixed steps that lead with decode rows).
    llm = LLM(model, attention_backend=backend, dtype="float32", max_num_batched_tokens=32, block_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        outs = [o for p in prompts for o in llm.generate([{"prompt_token_ids": p}], greedy)]
        hits = llm.engine.stats()["prefix_cache_hits"]
        outs += llm.generate([{"prompt_token_ids": p} for p in together], greedy)
        return [o.outputs[0].token_ids for o in outs], hits
    finally:
        llm.shutdown()


def test_per_phase_gives_each_backends_greedy_tokens(naive, tiny_llama):
    g = torch.Generator().manual_seed(0)
    head = torch.randint(3, 200, (48,), generator=g).tolist()
    prompts = [head + torch.randint(3, 200, (22,), generator=g).tolist() for _ in range(3)]
    together = [torch.randint(3, 200, (70,), generator=g).tolist() for _ in range(3)]
    ref, hits = _tokens(str(tiny_llama), "cpu", prompts, together)
    assert len(ref) == 6 and all(len(t) == 12 for t in ref) and hits >= 2 * 3  # 3 blocks, twice
    for backend in ("naive", "cpu+naive", "naive+cpu"):
        assert _tokens(str(tiny_llama), backend, prompts, together) == (ref, hits), backend


def test_each_step_goes_to_its_phase(naive, tiny_llama):
    sel = select_all(EngineConfig(model=str(tiny_llama), attention_backend="cpu+naive"), _info(tiny_llama))
    backend = sel.backend
    assert isinstance(backend, PerPhaseBackend) and backend.name == "cpu+naive"
    assert {p: c.name for p, c in sel.attention.phases.items()} == {"decode": "cpu", "mixed": "naive"}

    def meta(query_lens: list[int]) -> AttentionMetadata:
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(query_lens, dtype=torch.int32) + 4
        t, ql = int(qsl[-1]), torch.tensor(query_lens)
        table = torch.zeros(len(query_lens), 2, dtype=torch.int32)
        lead = int((ql != 1).int().argmax()) if (ql != 1).any() else len(query_lens)  # the runner's count
        return AttentionMetadata(torch.arange(t), qsl, lens, table, max(query_lens), int(lens.max()), t, lead)

    spec = AttentionSpec(4, 2, 8, torch.float32, 16, 8**-0.5, num_layers=1)
    builder, impl = backend.make_builder(spec, 0), backend.make_impl(spec, spec.layer(0))
    assert type(builder.build(meta([1, 1, 1]))).__name__ == "CPUMetadata"  # cpu's builder
    assert builder.build(meta([1, 5, 1])) is None and builder.build(meta([7])) is None  # naive's: all rows
    # wide decode's mixed step: decode rows lead and make at least half of the tokens
    assert type(builder.build(meta([1, 1, 1, 1, 4]))).__name__ == "CPUMetadata"
    assert builder.build(meta([1, 1, 1, 1, 5])) is None and builder.build(meta([5, 1, 1, 1, 1])) is None
    assert (impl.decode.backend.name, impl.mixed.backend.name) == ("cpu", "naive")


def test_explain_names_both_halves(naive, tiny_llama, capsys):
    from turnout.cli import main

    assert main(["explain", "--model", str(tiny_llama), "--attention-backend", "naive+cpu"]) == 0
    out = capsys.readouterr().out
    assert "decode steps: naive (naive_plugin)" in out and "mixed steps: cpu (cpu)" in out
    assert "serves the decode steps of naive+cpu" in out


RANKED = """
class Prefiller(NaiveBackend):
    name = "prefiller"
    mixed_priority = 50


class BlocksFirstPrefiller(Prefiller):
    name = "blocks_first_prefiller"
    mixed_priority = 60

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size, kv_lora_rank=None):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [NaiveBackend(), Prefiller(), *([BlocksFirstPrefiller()] if LAYOUTS_DIFFER else [])]
"""


def _ranked(register_plugin, layouts_differ: bool) -> None:
    """The example backend (priority -10) and a copy of it that ranks first for mixed steps; with
    layouts_differ, one ranked above both for mixed steps whose KV cache is laid out blocks first."""
    source = naive_backend_source().split("@turnout.hookimpl")[0] + RANKED
    mod = types.ModuleType("inproc_ranked_phases")
    mod.LAYOUTS_DIFFER = layouts_differ
    exec(compile(source, "inproc_ranked_phases", "exec"), mod.__dict__)
    register_plugin(mod, "ranked_plugin")


def test_auto_runs_the_backend_ranked_first_for_mixed_steps_on_them(register_plugin, tiny_llama, capsys):
    from turnout.cli import main

    _ranked(register_plugin, layouts_differ=False)
    att = select_all(EngineConfig(model=str(tiny_llama)), _info(tiny_llama)).attention
    assert att.chosen.name == "cpu+prefiller" and att.requested == "auto"
    assert {p: c.name for p, c in att.phases.items()} == {"decode": "cpu", "mixed": "prefiller"}
    naive = next(c for c in att.candidates if c.name == "naive")
    assert (
        att.why_lost(naive)
        == "priority -10 < cpu 0 (decode steps); mixed priority -10 < prefiller 50 (mixed steps)"
    )
    assert main(["explain", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    assert "decode steps: cpu (cpu)" in out and "mixed steps: prefiller (ranked_plugin)" in out


def test_auto_passes_over_a_mixed_step_backend_that_cannot_share_the_kv_cache(register_plugin, tiny_llama):
    _ranked(register_plugin, layouts_differ=True)
    att = select_all(EngineConfig(model=str(tiny_llama)), _info(tiny_llama)).attention
    assert att.chosen.name == "cpu+prefiller"
    assert att.note.startswith("blocks_first_prefiller ranks higher for mixed steps but cannot serve them: ")
    assert "KV-cache layouts differ" in att.note


def test_a_table_names_the_phases():
    cfg = EngineConfig(attention_backend={"decode": "triton", "mixed": "flash_attn"})
    assert cfg.attention_backend == "triton+flash_attn"
    with pytest.raises(ConfigError, match="exactly the keys decode and mixed"):
        EngineConfig.load(attention_backend={"decode": "triton"})


def test_halves_must_share_one_kv_layout(naive, tiny_llama):
    info = _info(tiny_llama)
    with pytest.raises(
        SelectionError, match=r"KV-cache layouts differ: naive \(2, 3, 16, 2, 16\), blocks_first"
    ):
        select_all(EngineConfig(model=str(tiny_llama), attention_backend="naive+blocks_first"), info)
    with pytest.raises(SelectionError, match="both phases name cpu; name it alone"):
        select_all(EngineConfig(model=str(tiny_llama), attention_backend="cpu+cpu"), info)
    with pytest.raises(SelectionError, match="needs device cuda, have cpu"):
        select_all(EngineConfig(model=str(tiny_llama), attention_backend="triton+cpu"), info)


@pytest.mark.parametrize(
    "decode, level",
    [
        ("ALWAYS", "UNIFORM_DECODE"),  # FULL decode graphs, PIECEWISE holes for the rest
        ("UNIFORM_DECODE", "UNIFORM_DECODE"),  # flashinfer for decode
        ("NEVER", "NEVER"),
    ],
)
def test_graph_support_follows_the_decode_half(decode, level):
    assert phase_support(CudagraphSupport[decode]) is CudagraphSupport[level]


def _info(model) -> ModelInfo:
    return ModelInfo.from_dir(model)


def test_warm_up_runs_the_decode_half_on_mixed_steps_at_every_band(naive, tiny_llama):
    """A mixed step of mostly decode rows runs on the decode half, whose eager kernels may take variants by
    sequence length (Triton's decode split count): the warm-up runs one at each band of length."""
    llm = LLM(str(tiny_llama), attention_backend="cpu+naive", dtype="float32", max_num_batched_tokens=64,
              block_size=16, enforce_eager=True)  # fmt: skip
    try:
        builder = llm.engine.executor.worker.runner.builders[0]
        seen, build = [], builder.decode.build
        builder.decode.build = lambda m: (seen.append((m.max_query_len, m.max_seq_len)), build(m))[1]
        llm.engine._warm_up()
        mixed = [length for q, length in seen if q > 1]
        assert all(any(length >= n for length in mixed) for n in (17, 33, 64)), seen  # the bands' prompts
    finally:
        llm.shutdown()
