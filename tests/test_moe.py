"""Qwen3-MoE end to end: greedy tokens against HF transformers (float32), the same tokens under expert
parallelism (tp x dp ranks over gloo), what each rank holds, and explain's account of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from turnout import LLM, SamplingParams
from turnout.cli import main
from turnout.errors import ConfigError, SelectionError
from turnout.layers import moe

from tiny_models import hf_greedy, make_tiny_model

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(20, 57)), [300], list(range(400, 419))]
KW = {"cpu_kv_cache_bytes": 1 << 22, "block_size": 8, "dtype": "float32"}
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def _tiny_moe(path: Path, **overrides) -> Path:
    return make_tiny_model(path, "qwen3_moe", num_kv_heads=2, **{**MOE, **overrides})


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_moe(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="module")
def hf_refs(tiny_moe: Path) -> list[list[int]]:
    return hf_greedy(tiny_moe, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def ep1(tiny_moe: Path):
    llm = LLM(str(tiny_moe), **KW)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2_ep(tiny_moe: Path):
    llm = LLM(str(tiny_moe), tensor_parallel_size=2, enable_expert_parallel=True, **KW)
    yield llm
    llm.shutdown()


def _reports(llm: LLM) -> list[dict]:
    engines = getattr(llm.engine, "engines", [llm.engine])
    return [r for e in engines for r in e.executor.collective_rpc("memory_report")]


def _w13(report: dict) -> list[list[int]]:
    return [s for n, s in sorted(report["shapes"].items()) if n.endswith("experts.w13_weight")]


def test_greedy_matches_hf(ep1: LLM, hf_refs: list[list[int]]) -> None:
    assert ep1.selection.model.chosen.name == "Qwen3MoeForCausalLM"
    assert ep1.selection.moe.chosen.name == "torch"
    assert _tokens(ep1) == hf_refs


def test_triton_kernel_in_the_model_matches_hf(
    tiny_moe: Path, hf_refs: list[list[int]], triton_kernels
) -> None:
    """The grouped GEMM serving the model (on the CPU under the Triton interpreter)."""
    triton_kernels(moe._kernel)
    llm = LLM(str(tiny_moe), moe_kernel="triton", **KW)
    try:
        assert llm.selection.moe.chosen.name == "triton"
        assert _tokens(llm, PROMPTS[:2]) == hf_refs[:2]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "overrides",
    [dict(norm_topk_prob=False, mlp_only_layers=[0]), dict(decoder_sparse_step=2, num_hidden_layers=3)],
    ids=["no-renorm-layer0-dense", "sparse-step-2"],
)
def test_dense_layers_and_unnormalised_routing_match_hf(tmp_path: Path, overrides: dict) -> None:
    path = _tiny_moe(tmp_path, **overrides)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path)
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert True in sparse and False in sparse
    llm = LLM(str(path), **KW)
    try:
        ours = llm.engine.executor.collective_rpc("memory_report")[0]["shapes"]
        assert [f"model.layers.{i}.mlp.experts.w13_weight" in ours for i in range(len(sparse))] == sparse
        assert _tokens(llm, PROMPTS[:2]) == hf_greedy(path, PROMPTS[:2], MAX_NEW)
    finally:
        llm.shutdown()


def test_routing_does_not_depend_on_the_batch(ep1: LLM, hf_refs: list[list[int]]) -> None:
    """The same prompt alone, and among others in one batch, gives the same tokens."""
    batch = _tokens(ep1, PROMPTS + [PROMPTS[1]] * 3)
    for i, p in enumerate(PROMPTS):
        assert _tokens(ep1, [p]) == [hf_refs[i]] == [batch[i]]
    assert batch[len(PROMPTS) :] == [hf_refs[1]] * 3


def test_ep2_matches_ep1_and_holds_half_the_experts(
    tp2_ep: LLM, ep1: LLM, hf_refs: list[list[int]], capsys: pytest.CaptureFixture
) -> None:
    assert tp2_ep.selection.executor.chosen.name == "multiproc"
    assert _tokens(tp2_ep) == _tokens(ep1) == hf_refs
    (one,), two = _reports(ep1), _reports(tp2_ep)
    assert _w13(one) == [[8, 64, 64]] * 2  # [experts, 2 x moe_intermediate, hidden], every layer
    assert [_w13(r) for r in two] == [[[4, 64, 64]] * 2] * 2  # each rank: its 4 experts, whole
    assert all(2 * r["expert_weight_bytes"] == one["expert_weight_bytes"] for r in two)
    with capsys.disabled():
        mib = lambda r: (
            f"{r['weight_bytes'] / 2**20:.3f} MiB ({r['expert_weight_bytes'] / 2**20:.3f} experts)"
        )
        print(f"\nweights per rank: EP=1 {mib(one)}; EP=2 " + ", ".join(mib(r) for r in two))


def test_ep2_batch_of_one_token_per_step(tp2_ep: LLM, hf_refs: list[list[int]]) -> None:
    """A single decoding request: TP rank 1's chunk of the step's one token is empty."""
    assert _tokens(tp2_ep, [PROMPTS[2]]) == [hf_refs[2]]


@pytest.mark.slow
def test_tp2_without_ep_splits_each_expert(tiny_moe: Path, hf_refs: list[list[int]]) -> None:
    llm = LLM(str(tiny_moe), tensor_parallel_size=2, **KW)
    try:
        assert _tokens(llm) == hf_refs
        assert [_w13(r) for r in _reports(llm)] == [[[8, 32, 64]] * 2] * 2  # moe_intermediate split by 2
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_dp2_ep_idle_replica_joins_with_dummy_steps(tiny_moe: Path, hf_refs: list[list[int]]) -> None:
    """Requests alternate between the two replicas; replica 1's finish after 2 tokens, and it keeps
    stepping (0 tokens through its MoE layers) while replica 0's decode on. A lone request leaves
    replica 1 idle from the start."""
    llm = LLM(str(tiny_moe), data_parallel_size=2, enable_expert_parallel=True, rpc_timeout=60, **KW)
    try:
        assert [_w13(r) for r in _reports(llm)] == [[[4, 64, 64]] * 2] * 2
        lens = [MAX_NEW, 2, MAX_NEW, 2]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        assert _tokens(llm, PROMPTS, params) == [r[:n] for r, n in zip(hf_refs, lens)]
        assert _tokens(llm, [PROMPTS[1]]) == [hf_refs[1]]
    finally:
        llm.shutdown()


def _route_to_first_half(src: Path, dst: Path) -> Path:
    """The router rows [a, -a, b, -b, 0, 0, 0, 0]: for any x, max(x.a, -x.a) >= 0 and max(x.b, -x.b) >= 0,
    so every token's top-2 lie in experts 0-3, EP rank 0's."""
    _tiny_moe(dst)
    weights = load_file(dst / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w[1], w[3], w[4:] = -w[0], -w[2], 0
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_all_tokens_routed_to_one_rank(tmp_path: Path) -> None:
    path = _route_to_first_half(tmp_path, tmp_path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path)
    logits = hf(torch.tensor([PROMPTS[1]]), output_router_logits=True).router_logits
    assert all(int(layer.topk(2).indices.max()) < 4 for layer in logits)
    refs = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, **KW)
    try:
        assert _tokens(llm) == refs
    finally:
        llm.shutdown()


def test_explain_shows_kernel_and_placement(tiny_moe: Path, capsys: pytest.CaptureFixture) -> None:
    flags = ["--model", str(tiny_moe), "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    assert main(["explain", *flags]) == 0
    text = capsys.readouterr().out
    assert "MoE kernel (requested: auto)" in text
    assert "rank 0: experts 0-3 (4)" in text and "rank 1: experts 4-7 (4)" in text
    assert main(["explain", "--json", *flags, "--data-parallel-size", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["experts"]["kernel"] == "torch" and doc["experts"]["ep_size"] == 4
    assert doc["experts"]["experts_per_rank"] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert {c["name"] for c in doc["kinds"]["moe"]["candidates"]} == {"torch", "triton"}
    assert main(["explain", "--json", "--model", str(tiny_moe)]) == 0
    assert json.loads(capsys.readouterr().out)["experts"]["layout"] == "every rank holds every expert"


def test_expert_parallel_errors(tiny_moe: Path, tiny_qwen3: Path) -> None:
    for key, value in (("enable_expert_parallel", True), ("moe_kernel", "torch")):
        with pytest.raises(ConfigError, match=f"{key} is set, but Qwen3ForCausalLM has no experts; unset it"):
            LLM(str(tiny_qwen3), **{key: value}, **KW)
    with pytest.raises(SelectionError, match="MoE kernel 'triton' cannot be used: needs a CUDA device"):
        LLM(str(tiny_moe), moe_kernel="triton", **KW)
    with pytest.raises(ConfigError, match="8 experts do not split over 16 expert-parallel ranks"):
        LLM(str(tiny_moe), enable_expert_parallel=True, tensor_parallel_size=4, data_parallel_size=4, **KW)
    with pytest.raises(ConfigError, match="runs without pipeline stages"):
        LLM(str(tiny_moe), enable_expert_parallel=True, data_parallel_size=2, pipeline_parallel_size=2, **KW)
    with pytest.raises(ConfigError, match="needs executor=multiproc"):
        LLM(str(tiny_moe), enable_expert_parallel=True, data_parallel_size=2, executor="uniproc", **KW)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_cuda_triton_experts_match_hf_eager_and_in_graphs(
    tiny_moe: Path, hf_refs: list[list[int]], mode: str
) -> None:
    """float32 on CUDA: the grouped GEMM (IEEE dots) gives HF's tokens, eager and captured in CUDA graphs
    (moe_align never waits on the device)."""
    llm = LLM(str(tiny_moe), dtype="float32", cudagraph_mode=mode, gpu_memory_utilization=0.3)
    try:
        assert llm.selection.moe.chosen.name == "triton"
        assert llm.selection.effective_graph.name == mode
        assert _tokens(llm) == hf_refs
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_cuda_ep2_matches_ep1(tiny_moe: Path, hf_refs: list[list[int]]) -> None:
    """NCCL all-to-all: EP=2 over two GPUs, attention TP and DP, in float32."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for kw in (dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
        llm = LLM(
            str(tiny_moe), dtype="float32", enable_expert_parallel=True, gpu_memory_utilization=0.3, **kw
        )
        try:
            assert llm.selection.effective_graph.name == "NONE"
            assert _tokens(llm) == hf_refs
        finally:
            llm.shutdown()
