"""turnout bench: nano-vllm's prompts, the roofline arithmetic, the record schema, and runs on the CPU."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
from pathlib import Path

import pytest

from turnout.bench import records, roofline, workloads
from turnout.cli import build_parser, main
from turnout.errors import TurnoutError

from tiny_models import make_tiny_model


def test_throughput_prompts_are_nano_vllms():
    # nano-vllm's bench.py, as it is written there: the module-level generator after seed(0)
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    reqs = workloads.throughput()
    assert [r.prompt for r in reqs] == prompts
    assert [r.max_tokens for r in reqs] == max_tokens
    assert all(r.temperature == 0.6 and r.ignore_eos for r in reqs)
    assert workloads.throughput(4) == reqs[:4]  # a shrunk workload is the same workload's first requests


def test_wide_prompts_are_short_and_outputs_long():
    # the documented draw: per request after Random(0), its prompt length, its ids, then its output length
    rng = random.Random(0)
    want = []
    for _ in range(1024):
        prompt = [rng.randint(0, 10000) for _ in range(rng.randint(16, 64))]
        want.append((prompt, rng.randint(256, 512)))
    reqs = workloads.wide()
    assert [(r.prompt, r.max_tokens) for r in reqs] == want
    assert all(r.temperature == 0.6 and r.ignore_eos for r in reqs)
    assert workloads.wide(4) == reqs[:4]  # shrunk, the same workload's first requests
    assert {len(r.prompt) for r in workloads.wide(8, (3, 3), (2, 2))} == {3}


def test_roofline_floor_by_hand():
    shape = roofline.Shape(weight_params=1000, kv_bytes_per_token=10, attn_flops_per_pair=4, dtype_bytes=2)
    ceiling = roofline.Ceiling(bytes_per_s=1e3, flops_per_s=1e4, where="test")
    # request A: 3 prompt tokens, none cached, 2 outputs; request B: 2 prompt tokens, 1 cached, 3 outputs
    f = roofline.floor(shape, [(3, 0, 2), (2, 1, 3)], ceiling)
    # steps: the longest output, 3
    # tokens through the model: A 3 prompt + 1 decode = 4, B 1 prompt + 2 decode = 3 -> 7
    # KV read by decodes: A one decode over 4 keys; B decodes over 3 and 4 keys -> 11; B's cached token: 1
    # bytes: weights 2 * 1000 * 3 = 6000, KV 10 * (11 + 1 + 7 written) = 190
    assert f.steps == 3 and f.bytes == 6190
    # attention pairs: A positions 0..3 see 1+2+3+4 = 10 keys, B positions 1..3 see 2+3+4 = 9 -> 19
    assert f.flops == 2 * 1000 * 7 + 4 * 19
    assert f.seconds == pytest.approx(6.19) and f.bound == "memory"
    # compute-bound once bandwidth is plentiful: 14076 FLOPs at 1e4 FLOP/s
    fast_memory = roofline.Ceiling(bytes_per_s=1e9, flops_per_s=1e4, where="test")
    assert roofline.floor(shape, [(3, 0, 2), (2, 1, 3)], fast_memory).seconds == pytest.approx(1.4076)


def test_roofline_of_nano_vllms_bench_on_an_h200():
    # Qwen3-0.6B: 28 layers of q 1024x2048, k and v 1024x1024, o 2048x1024, MLP 3 x 1024x3072, and the
    # tied 151936x1024 LM head; 8 KV heads of 128 in bf16. The estimate of this floor: ~37,800 tok/s.
    layer = 1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072
    shape = roofline.Shape(28 * layer + 151936 * 1024, 2 * 28 * 8 * 128 * 2, 4 * 28 * 16 * 128, 2)
    reqs = workloads.throughput()
    f = roofline.floor(shape, workloads.shapes(reqs), roofline.ceiling_for("NVIDIA H200"))
    assert f.bound == "memory" and f.steps == max(r.max_tokens for r in reqs)
    assert sum(r.max_tokens for r in reqs) / f.seconds == pytest.approx(37_800, rel=0.03)
    assert roofline.ceiling_for("cpu (x86_64, 2 threads)") is None


def test_shape_from_checkpoint_counts_hf_parameters(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, "qwen3", num_kv_heads=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = hf.config
    embed = hf.get_input_embeddings().weight.numel()  # untied: gathered, not read whole, each step
    shape = roofline.Shape.from_checkpoint(path, dtype_bytes=2)
    assert shape.weight_params == sum(p.numel() for p in hf.parameters()) - embed
    assert shape.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2


def test_shape_of_a_latent_cache_and_routed_experts(tmp_path):
    """DeepSeek-V2: one latent vector of kv_lora_rank + qk_rope_head_dim a token and layer, as HF's own cache
    holds it, against K (qk_nope + qk_rope) and V (v_head_dim) of every head; routed experts counted from
    HF's parameters."""
    import torch
    import transformers

    config = transformers.DeepseekV2Config(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16,
        q_lora_rank=None, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    with torch.no_grad():
        cache = hf(torch.arange(5)[None], use_cache=True).past_key_values
    hf_bytes = sum(t.numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values)) // 5
    shape = roofline.Shape.from_checkpoint(tmp_path, dtype_bytes=2)
    assert shape.kv_bytes_per_token == hf_bytes == 2 * (32 + 8) * 2
    assert shape.standard_kv_bytes_per_token == 2 * 4 * (24 + 8 + 16) * 2
    fp8 = shape.cached_in(1)  # an FP8 cache: one byte a value
    assert (fp8.kv_bytes_per_token, fp8.standard_kv_bytes_per_token) == (2 * (32 + 8), 2 * 4 * (24 + 8 + 16))
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    assert experts == 8 * 3 * 64 * 32 and (shape.expert_params, shape.expert_share) == (experts, 2 / 8)


def test_records_count_the_kv_cache_the_engine_allocates(tmp_path, caplog):
    """kv_bytes_per_token in turnout's records is what the engine allocates a token: float32 values, and one
    byte each where the checkpoint's kv_cache_scheme makes the default (auto) an FP8 cache."""
    from test_fp8_kv_scales import with_kv_scales

    src = make_tiny_model(tmp_path / "m", "llama", vocab_size=10240)  # nano-vllm's prompt ids fit
    sizes = ["--max-model-len", "256", "--num-prompts", "2", "--max-input-len", "16", "--max-output-len", "2"]
    for model, value_bytes in ((src, 4), (with_kv_scales(src, tmp_path / "fp8-kv"), 1)):
        out, _ = tmp_path / f"{model.name}.json", caplog.clear()
        with caplog.at_level("INFO"):
            assert main(["bench", "throughput", "--model", str(model), *sizes, "--out", str(out)]) == 0
        allocated = int(re.search(r"\((\d+) bytes a token a rank\)", caplog.text).group(1))
        for rec in json.loads(out.read_text()):
            assert rec["kv_bytes_per_token"] == allocated == 2 * 2 * 2 * 16 * value_bytes  # K, V; 2 layers
            assert "standard_kv_bytes_per_token" not in rec


def test_roofline_reads_the_experts_a_batch_reaches():
    # 1000 weights, 600 of them in routed experts; a token routes to a quarter of them
    shape = roofline.Shape(1000, 10, 4, 2, expert_params=600, expert_share=0.25)
    ceiling = roofline.Ceiling(bytes_per_s=1e3, flops_per_s=1e4, where="test")
    one = roofline.floor(shape, [(3, 0, 2)], ceiling)
    # one request: each step reads 400 + 600 / 4 = 550 weights, 2 steps; KV 10 * (4 decode reads + 4 written)
    assert one.bytes == pytest.approx(2 * 2 * 550 + 10 * 8)
    # 4 tokens through the model, each multiplying 550 weights; attention pairs 1 + 2 + 3 + 4
    assert one.flops == pytest.approx(2 * 550 * 4 + 4 * 10)
    # two requests at once reach 1 - 0.75^2 of the experts a step
    two = roofline.floor(shape, [(3, 0, 2), (3, 0, 2)], ceiling)
    assert two.bytes == pytest.approx(2 * 2 * (400 + 600 * (1 - 0.75**2)) + 10 * 16)


def _record(workload: str, **metrics) -> dict:
    base = dict(engine="turnout", model="m", device="d", commit="c", date="t", command="x", config={})
    return {"workload": workload, "run": "first", **base, **metrics}


def test_record_schema():
    records.check(_record("throughput", output_tokens_per_s=1.0))
    records.check(_record("latency", tpot_ms=1.0, ttft_ms={"512": 2.0}))
    records.check(_record("prefix", speedup_vs_no_cache=3.0))
    structured = dict(structured_output_ratio=1.0, num_constrained=4, output_tokens_per_s=9.0,
                      unconstrained_output_tokens_per_s=10.0, mean_output_len=5.0)  # fmt: skip
    records.check(_record("structured", **structured, structured_cost=0.1))
    with pytest.raises(TurnoutError, match="lacks structured_cost"):
        records.check(_record("structured", **structured))
    with pytest.raises(TurnoutError, match="lacks output_tokens_per_s"):
        records.check(_record("throughput"))
    with pytest.raises(TurnoutError, match="lacks ttft_ms"):
        records.check(_record("latency", tpot_ms=1.0))
    with pytest.raises(TurnoutError, match="workload 'serving'"):
        records.check(_record("serving"))
    records.check({**_record("latency", tpot_ms=1.0, ttft_ms={}), "engine": "vllm"})
    with pytest.raises(TurnoutError, match="engine 'sglang'"):
        records.check({**_record("prefix", speedup_vs_no_cache=3.0), "engine": "sglang"})
    with pytest.raises(TurnoutError, match="lacks commit"):
        records.check({k: v for k, v in _record("prefix", speedup_vs_no_cache=3.0).items() if k != "commit"})


@pytest.mark.parametrize(
    "argv, error",
    [
        (["throughput", "--peers", "sglang"], "unknown peer 'sglang'"),
        (["throughput", "--peers", "vllm", "--max-input-len", "64"], "vllm runs nano-vllm's bench.py"),
        (["latency", "--peers", "vllm", "--tpot-tokens", "8"], "vllm's TPOT is over 256 tokens"),
        (["prefix", "--peers", "hf-generate"], "drop --peers"),
        (["throughput", "--peers", "nano-vllm", "--num-prompts", "8"], "nano-vllm runs its own bench.py"),
        (["latency", "--peers", "hf-generate-batch"], "no batch-1 latency mode"),
        (["structured", "--peers", "vllm"], "the structured workload compares turnout with itself"),
        (["structured", "--num-prompts", "2", "--structured-output-ratio", "0.2"], "constrains none of 2"),
        (["wide", "--peers", "hf-generate"], "hf-generate runs the throughput workload's subset only"),
        (["wide", "--min-output-len", "9", "--max-output-len", "8"], "need 1 <= min <= max"),
        (["wide", "--num-prompts", "0"], "--num-prompts 0: need at least 1"),
    ],
)
def test_bad_bench_options_are_one_line_errors(argv, error, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert error in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_throughput_smoke_writes_valid_records(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    argv = ["bench", "throughput", "--num-prompts", "4", "--max-input-len", "32", "--max-output-len", "4"]
    monkeypatch.setattr("sys.argv", ["turnout", *argv, "--out", str(out)])
    assert main([*argv, "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["engine"], r["run"]) for r in recs] == [("turnout", "first"), ("turnout", "repeat")]
    for r in recs:
        records.check(r)
        assert r["output_tokens"] == 4 * 4 and r["output_tokens_per_s"] == pytest.approx(16 / r["seconds"])
        env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k.startswith("TURNOUT_")]
        assert r["command"] == " ".join([*env, "turnout", *argv, "--out", str(out)])  # TURNOUT_* as typed
        assert r["config"]["engine"]["max_model_len"] == 4096 and r["config"]["workload"]["num_prompts"] == 4
        assert r["config"]["attention"] == "cpu" and r["startup_s"] > 0
        assert "fraction_of_floor" not in r  # no ceiling is known for a CPU


@pytest.mark.slow
def test_hf_peers_run_the_same_subset(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama", vocab_size=10240, max_position_embeddings=1024)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7, 8], "max_tokens": 3}\n{"prompt": "w1 w2 w3"}\n')
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["bench", "throughput", "--model", str(model), "--max-model-len", "256", "--input", str(prompts),
            "--max-tokens", "5", "--peers", "hf-generate,hf-generate-batch", "--peer-subset", "2",
            "--peer-output-len", "3", "--out", str(out)]  # fmt: skip
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(png)]
    except ImportError:
        png.write_bytes(b"\x89PNG")  # --plot's own check needs matplotlib (the bench extra)
    assert main(argv) == 0
    recs = {(r["engine"], r["run"], r.get("subset")): r for r in json.loads(out.read_text())}
    full = recs["turnout", "first", None]
    assert full["output_tokens"] == 3 + 5 and full["config"]["workload"]["input"] == str(prompts)
    for run in ("first", "repeat"):
        ours = recs["turnout", run, 2]
        for engine, key in (("hf-generate-batch", "ratio_vs_peer"), ("hf-generate", "ratio_vs_hf_generate")):
            peer = recs[engine, run, 2]
            assert peer["output_tokens"] == ours["output_tokens"] == 2 * 3  # same subset, same lengths
            assert ours[key] == pytest.approx(ours["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
def test_bench_on_the_gpu_against_hf(tmp_path):
    out = tmp_path / "r.json"
    argv = ["bench", "throughput", "--random-model", "qwen3-0.6b", "--num-prompts", "32", "--peers",
            "hf-generate-batch", "--peer-subset", "8", "--peer-output-len", "32"]  # fmt: skip
    argv += ["--out", str(out)]
    assert main(argv) == 0
    recs = json.loads(out.read_text())
    ours = [r for r in recs if r["engine"] == "turnout" and "subset" not in r]
    if roofline.ceiling_for(ours[0]["device"]):
        assert all(0 < r["fraction_of_floor"] < 1 for r in ours)
    assert all(r["ratio_vs_peer"] > 1 for r in recs if r["engine"] == "turnout" and r.get("subset"))


@pytest.mark.slow
def test_a_failed_peer_leaves_turnouts_records(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "m", "llama", vocab_size=10240, max_position_embeddings=1024)
    out = tmp_path / "r.json"
    argv = ["bench", "throughput", "--model", str(model), "--max-model-len", "256", "--num-prompts", "2",
            "--max-input-len", "8", "--max-output-len", "2"]  # fmt: skip
    argv += ["--peers", "hf-generate", "--peer-timeout", "0.01"]
    assert main([*argv, "--out", str(out)]) == 1  # the exit status says a peer failed
    assert "error: peer hf-generate ran past" in capsys.readouterr().err
    assert {r["engine"] for r in json.loads(out.read_text())} == {"turnout"}


def test_random_checkpoint_in_a_real_shape_loads_in_turnout_and_hf(tmp_path, monkeypatch):
    import torch

    from turnout import LLM, SamplingParams
    from turnout.bench import random_models

    from tiny_models import hf_greedy

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)  # fmt: skip
    monkeypatch.setitem(random_models.SHAPES, "tiny", ("qwen3", shape))
    monkeypatch.setattr(random_models, "SHARD_BYTES", 64 * 1024)  # several shards and their index
    path = random_models.make_random_model(tmp_path / "tiny", "tiny")
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 40960
    assert len(list(path.glob("*.safetensors"))) > 1 and (path / "model.safetensors.index.json").is_file()
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    assert llm.selection.dtype == torch.float32 and llm.engine.info.architecture == "Qwen3ForCausalLM"
    prompt = [5, 6, 7, 8]
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
    assert ours == hf_greedy(path, [prompt], 4)[0]
    llm.shutdown()


@pytest.mark.parametrize(
    "n,processes,limit", [(256, 8, None), (10, 4, 10), (10, 8, 3), (5, 8, None), (7, 3, 5)]
)
def test_bench_serve_deals_every_request_once_within_max_concurrency(n, processes, limit):
    from turnout.bench.serve import deal

    offsets = [0.1 * i for i in range(n)]
    parts, gates = deal(offsets, processes, limit)
    assert sorted(i for p in parts for i, _ in p) == list(range(n))  # each request once
    assert all(at == offsets[i] for p in parts for i, at in p)  # on the shared schedule
    assert len(parts) == len(gates) <= processes and min(gates) >= 1
    assert sum(gates) == (limit or n)  # --max-concurrency holds across the processes


# ---- vLLM as a peer: vllmbench.py and vLLM itself are external, so the test writes stand-ins for them ----
FAKE_VLLMBENCH = """import json, os, sys
res = {"engine": "vllm", "version": "0.0-test", "startup_s": 1.5, "argv": sys.argv[1:],
       "PYTHONPATH": os.environ.get("PYTHONPATH"), "mode": os.environ.get("MODE"),
       "precision": [os.environ.get("QUANTIZATION"), os.environ.get("KV_CACHE_DTYPE")]}
res.update({"tpot_ms": 2.5} if os.environ.get("MODE") == "tpot" else {"first": 1000, "repeat": 2000})
print("some log line")
print("RESULT", json.dumps(res))
"""
FAKE_VLLM = """import json, os, time
__version__ = "0.0-test"

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class TokensPrompt(dict):
    pass

class LLM:
    def __init__(self, model, **kw):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"model": model, **kw, "PYTHONPATH": os.environ["PYTHONPATH"]}) + "\\n")

    def generate(self, prompts, params, use_tqdm=True):
        time.sleep(sum(len(p["prompt_token_ids"]) for p in prompts if isinstance(p, dict)) * 1e-4)
        params = params if isinstance(params, list) else [params] * len(prompts)
        if os.environ.get("FAKE_VLLM_GENERATE_LOG"):
            with open(os.environ["FAKE_VLLM_GENERATE_LOG"], "a") as f:
                pairs = zip(params, prompts)
                asked = [dict(p.kw, prompt=q["prompt_token_ids"]) for p, q in pairs if isinstance(q, dict)]
                f.write(json.dumps(asked) + "\\n")
        return [Output(p.kw.get("max_tokens", 16)) for p in params]


class Output:
    def __init__(self, n):
        self.outputs = [type("Completion", (), {"token_ids": [0] * n})()]
"""


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A peers dir with a vllmbench.py, a site folder with a vllm package, and the log its LLM writes."""
    peers_dir, site = tmp_path / "peers", tmp_path / "vllm-site"
    (site / "vllm").mkdir(parents=True)
    peers_dir.mkdir()
    (peers_dir / "vllmbench.py").write_text(FAKE_VLLMBENCH)
    (site / "vllm/__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "llm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "flashinfer-site"))  # turnout's own, never vLLM's
    monkeypatch.setenv("MODE", "tpot")  # a stray MODE does not turn a throughput run into a TPOT one
    monkeypatch.setenv("KV_CACHE_DTYPE", "fp8")  # nor a stray KV_CACHE_DTYPE change vLLM's precision
    return peers_dir, site, log


def test_vllm_runs_with_its_site_as_its_whole_pythonpath_at_turnouts_precision(fake_vllm, tmp_path):
    from turnout.bench import peers

    peers_dir, site, log = fake_vllm
    res = peers.bench_py("vllm", "/m", peers_dir, tpot=False, timeout=60, site=site)
    assert res["PYTHONPATH"] == str(site) and res["mode"] is None and res["argv"] == ["/m"]
    assert (res["first"], res["repeat"]) == (1000, 2000) and res["precision"] == [None, None]
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}  # turnout's precision, vLLM's names
    res = peers.bench_py("vllm", "/m", peers_dir, tpot=False, timeout=60, site=site, precision=fp8)
    assert res["precision"] == ["fp8", "fp8"]
    as_checkpoint = {"quantization": None, "kv_cache_dtype": "auto"}  # vllmbench.py reads "" as None
    res = peers.bench_py("vllm", "/m", peers_dir, tpot=False, timeout=60, site=site, precision=as_checkpoint)
    assert res["precision"] == ["", "auto"]
    plan = {"runs": {}, "max_model_len": 64, "precision": fp8}  # the peer over a workload's own requests
    peers.child("vllm", "/m", "bfloat16", plan, 60, peers.vllm_env(site))
    started = json.loads(log.read_text().splitlines()[-1])
    assert {k: started[k] for k in (*fp8, "max_model_len")} == {**fp8, "max_model_len": 64}
    res = peers.bench_py("vllm", "/m", peers_dir, tpot=True, timeout=60, site=site)
    assert res["mode"] == "tpot" and res["tpot_ms"] == 2.5
    with pytest.raises(TurnoutError, match=r"no vllm/ in .*nowhere; pass --vllm-site DIR") as e:
        peers.bench_py("vllm", "/m", peers_dir, tpot=False, timeout=60, site=tmp_path / "nowhere")
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(TurnoutError, match="no vllmbench.py in"):
        peers.find_peers_dir(str(tmp_path), "vllmbench.py")


@pytest.fixture
def cpu_ceiling(monkeypatch):
    """A stand-in ceiling for this CPU, so that the floors are worked out here (CEILINGS holds measured GPUs
    only): at 1e10 B/s and 1e11 FLOP/s, the tiny models' steps are bound by their weight reads."""
    ceiling = roofline.Ceiling(bytes_per_s=1e10, flops_per_s=1e11, where="a stand-in")
    monkeypatch.setitem(roofline.CEILINGS, "cpu", ceiling)
    return ceiling


def _floor_s(model: Path, shapes: list[tuple[int, int, int]], ceiling, max_num_seqs: int) -> float:
    """The floor of float32 requests of (prompt, cached, output) tokens on model, as the roofline works it."""
    return roofline.floor(roofline.Shape.from_checkpoint(model, 4), shapes, ceiling, max_num_seqs).seconds


def _assert_near_floor(rec: dict, floor_s: float) -> None:
    """rec carries floor_s and its time over it: seconds over the floor's, the floor's rate the inverse."""
    assert rec["floor_s"] == pytest.approx(floor_s)
    assert rec["floor_output_tokens_per_s"] == pytest.approx(rec["output_tokens"] / floor_s)
    assert rec["over_floor"] == pytest.approx(rec["output_tokens"] / rec["output_tokens_per_s"] / floor_s)
    assert rec["fraction_of_floor"] == pytest.approx(1 / rec["over_floor"])


WIDE = ["--num-prompts", "6", "--min-input-len", "4", "--max-input-len", "8", "--min-output-len", "3",
        "--max-output-len", "5", "--max-model-len", "128"]  # fmt: skip


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A tiny qwen3 whose vocabulary holds the bench prompts' ids."""
    return make_tiny_model(
        tmp_path_factory.mktemp("wide"), "qwen3", vocab_size=10240, max_position_embeddings=1024
    )


@pytest.mark.slow
def test_wide_runs_beside_vllm_on_the_same_requests_with_each_runs_floor(
    wide_model, fake_vllm, cpu_ceiling, tmp_path, monkeypatch, capsys
):
    peers_dir, site, _ = fake_vllm
    asked = tmp_path / "asked.jsonl"
    monkeypatch.setenv("FAKE_VLLM_GENERATE_LOG", str(asked))
    out = tmp_path / "r.json"
    argv = ["bench", "wide", "--model", str(wide_model), *WIDE, "--peers", "vllm", "--vllm-site", str(site),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    recs = {(r["engine"], r["run"]): r for r in json.loads(out.read_text())}
    assert sorted(recs) == [(e, run) for e in ("turnout", "vllm") for run in ("first", "repeat")]
    reqs = workloads.wide(6, (4, 8), (3, 5))
    # vLLM ran these requests, every run: same prompts, lengths and sampling
    want = [dict(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens, prompt=r.prompt) for r in reqs]
    assert [json.loads(line) for line in asked.read_text().splitlines()][-2:] == [want, want]
    tokens = sum(r.max_tokens for r in reqs)
    seqs = recs["turnout", "first"]["config"]["max_num_seqs"]
    assert seqs == 256  # fitted for the CPU
    first = _floor_s(wide_model, [(len(r.prompt), 0, r.max_tokens) for r in reqs], cpu_ceiling, seqs)
    repeat = _floor_s(wide_model, [(len(r.prompt), len(r.prompt) - 1, r.max_tokens) for r in reqs],
                      cpu_ceiling, seqs)  # fmt: skip
    for run, floor_s in (("first", first), ("repeat", repeat)):
        ours, vllm = recs["turnout", run], recs["vllm", run]
        records.check(ours), records.check(vllm)
        assert ours["output_tokens"] == vllm["output_tokens"] == tokens and ours["num_prompts"] == 6
        _assert_near_floor(ours, floor_s)
        _assert_near_floor(vllm, floor_s)
        assert ours["ratio_vs_vllm"] == pytest.approx(
            ours["output_tokens_per_s"] / vllm["output_tokens_per_s"]
        )
        assert (
            vllm["config"]["runner"] == "turnout.bench.peers vllm" and vllm["config"]["max_model_len"] == 128
        )
        assert (vllm["config"]["quantization"], vllm["config"]["kv_cache_dtype"]) == (None, "auto")
    assert recs["turnout", "first"]["config"]["workload"]["max_output_len"] == 5
    assert "prefix_cache_hit_rate" in recs["turnout", "repeat"]
    assert f"floor first {first:.3g} s" in printed and f"repeat {repeat:.3g} s" in printed


@pytest.mark.slow
def test_wide_with_an_absent_peer_keeps_turnouts_records(wide_model, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "wide", "--model", str(wide_model), *WIDE, "--peers", "vllm", "--vllm-site",
            str(tmp_path / "nowhere"), "--out", str(out)]  # fmt: skip
    assert main(argv) == 1  # the exit status says a peer did not run
    assert "vllm peer: no vllm/ in" in capsys.readouterr().err
    recs = json.loads(out.read_text())
    assert [(r["engine"], r["run"]) for r in recs] == [("turnout", "first"), ("turnout", "repeat")]
    for r in recs:
        records.check(r)
        assert "ratio_vs_vllm" not in r and "floor_s" not in r  # no peer, and no ceiling known for a CPU


def _bench(argv: list[str]):
    from turnout.bench.runner import Bench

    args = build_parser().parse_args(["bench", *argv])
    return Bench(args, [p for p in args.peers.split(",") if p])


@pytest.mark.parametrize("workload", ["throughput", "latency", "prefix"])
def test_a_bench_reads_the_tune_records_of_its_own_workload(tmp_path, workload):
    """`turnout bench latency` selects from latency records, as `turnout tune --workload latency` made them;
    a --tune-workload given still wins."""
    model = str(make_tiny_model(tmp_path / "m", "llama"))
    assert _bench([workload, "--model", model]).cfg.tune_workload == workload
    given = _bench([workload, "--model", model, "--tune-workload", "prefix"]).cfg
    assert given.tune_workload == "prefix" and given.source("tune_workload") == "flag"


@pytest.mark.slow
def test_throughput_ratio_vs_vllm_from_its_result_line(fake_vllm, cpu_ceiling, tmp_path, capsys):
    peers_dir, site, _ = fake_vllm
    model = make_tiny_model(tmp_path / "m", "llama", vocab_size=10240, max_position_embeddings=1024)
    argv = ["throughput", "--model", str(model), "--max-model-len", "256", "--num-prompts", "3",
            "--max-input-len", "8", "--max-output-len", "2", "--peers", "vllm",
            "--peers-dir", str(peers_dir)]  # fmt: skip
    bench = _bench([*argv, "--vllm-site", str(site)])
    recs, _ = bench.throughput()
    for r in recs:
        records.check(r)
    by = {(r["engine"], r["run"]): r for r in recs}
    for run, vllm_tok_s in (("first", 1000), ("repeat", 2000)):
        ours = by["turnout", run]
        assert by["vllm", run]["output_tokens_per_s"] == vllm_tok_s and by["vllm", run]["startup_s"] == 1.5
        assert ours["ratio_vs_vllm"] == pytest.approx(ours["output_tokens_per_s"] / vllm_tok_s)
        assert "ratio_vs_nano_vllm" not in ours
        assert by["vllm", run]["floor_s"] == ours["floor_s"]  # one floor per run, for every engine
        assert by["vllm", run]["over_floor"] == pytest.approx(ours["floor_output_tokens_per_s"] / vllm_tok_s)
    reqs = workloads.throughput(3, 8, 2)
    shapes = [(len(r.prompt), 0, r.max_tokens) for r in reqs]
    assert by["turnout", "first"]["floor_s"] == pytest.approx(_floor_s(model, shapes, cpu_ceiling, 256))
    assert by["vllm", "first"]["config"]["version"] == "0.0-test" and not bench.failed
    bench = _bench([*argv, "--vllm-site", str(tmp_path / "nowhere")])  # not installed: one line, ours kept
    recs, _ = bench.throughput()
    assert {r["engine"] for r in recs} == {"turnout"} and bench.failed == ["vllm"]
    assert all("ratio_vs_vllm" not in r for r in recs)
    err = [line for line in capsys.readouterr().err.splitlines() if "vllm" in line]
    assert len(err) == 1 and "--vllm-site" in err[0] and "records are left out" in err[0]


@pytest.mark.slow
def test_latency_against_vllm_times_ttft_up_to_max_model_len(fake_vllm, cpu_ceiling, tmp_path, capsys):
    peers_dir, site, log = fake_vllm
    model = make_tiny_model(tmp_path / "m", "llama", vocab_size=10240, max_position_embeddings=1024)
    out = tmp_path / "r.json"
    argv = ["bench", "latency", "--model", str(model), "--ttft-lens", "16,64,4096", "--peers", "vllm",
            "--peers-dir", str(peers_dir), "--vllm-site", str(site), "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "note: TTFT skipped at 4096 tokens" in capsys.readouterr().err
    recs = {(r["engine"], r["run"]): r for r in json.loads(out.read_text())}
    assert set(recs) == {(e, run) for e in ("turnout", "vllm") for run in ("first", "repeat")}
    (llm_kw,) = [json.loads(line) for line in log.read_text().splitlines()]  # one TTFT process
    want = {"model": str(model), "max_model_len": 1024, "seed": 0, "PYTHONPATH": str(site)}
    assert llm_kw == {**want, "quantization": None, "kv_cache_dtype": "auto"}  # at turnout's precision
    for run in ("first", "repeat"):
        ours, peer = recs["turnout", run], recs["vllm", run]
        assert set(ours["ttft_ms"]) == set(peer["ttft_ms"]) == {"16", "64"} and ours["ttft_skipped"] == [4096]
        assert peer["ttft_ms"]["64"] >= 6.4  # the stand-in sleeps 0.1 ms a prompt token, timed by our child
        assert peer["tpot_ms"] == 2.5 and ours["tpot_ratio_vs_vllm"] == pytest.approx(ours["tpot_ms"] / 2.5)
        for n in ("16", "64"):
            assert ours["ttft_ratio_vs_vllm"][n] == pytest.approx(ours["ttft_ms"][n] / peer["ttft_ms"][n])
        tpot_floor = _floor_s(model, [(32, 0, 257)], cpu_ceiling, 1) - _floor_s(
            model, [(32, 0, 1)], cpu_ceiling, 1
        )
        for r in (ours, peer):  # every engine's times over the same floors
            assert r["tpot_floor_ms"] == pytest.approx(tpot_floor / 256 * 1e3)
            assert r["tpot_over_floor"] == pytest.approx(r["tpot_ms"] / r["tpot_floor_ms"])
            for n in ("16", "64"):
                assert r["ttft_floor_ms"][n] == pytest.approx(
                    _floor_s(model, [(int(n), 0, 1)], cpu_ceiling, 1) * 1e3
                )
                assert r["ttft_over_floor"][n] == pytest.approx(r["ttft_ms"][n] / r["ttft_floor_ms"][n])
        assert ours["config"]["engine"]["max_model_len"] == 1024 and peer["config"]["max_model_len"] == 1024


def test_qwen3_8b_shape_is_qwen3_8bs_with_qwen3s_positions():
    from turnout.bench.random_models import random_config

    cfg = random_config("qwen3-8b")
    assert type(cfg).__name__ == "Qwen3Config"
    want = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936,
                tie_word_embeddings=False)  # fmt: skip
    assert {k: getattr(cfg, k) for k in want} == want and cfg.rope_parameters["rope_theta"] == 1e6
    assert all(random_config(s).max_position_embeddings == 40960 for s in ("qwen3-0.6b", "llama-3-8b"))
    assert cfg.max_position_embeddings == 40960
    args = build_parser().parse_args(["bench", "throughput", "--random-model", "qwen3-8b"])
    assert args.random_model == "qwen3-8b" and args.vllm_site == "/tmp/vllm-site"


def test_a_random_model_made_with_fewer_positions_gets_qwen3s(tmp_path):
    from turnout.bench.random_models import make_random_model

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "vocab_size": 9}))
    assert make_random_model(tmp_path, "qwen3-0.6b") == tmp_path  # complete: reused, not rewritten
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "max_position_embeddings": 40960, "vocab_size": 9
    }  # fmt: skip


# ---- structured: nano-vllm's requests, some held to a JSON schema, against the same work unconstrained ----
SMALL_SCHEMA = {  # outputs that complete within 64 tokens
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "text": {"type": "string", "maxLength": 8},
    },
    "required": ["id", "tags", "text"],
}


@pytest.fixture(scope="module")
def json_model(tmp_path_factory) -> Path:
    """A tiny llama with nano-vllm's prompt ids and the random models' tokenizer, which spells JSON."""
    from turnout.bench.random_models import write_tokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("json_model"), "llama", vocab_size=10240,
                           max_position_embeddings=1024)  # fmt: skip
    write_tokenizer(path, 10240)
    return path


def test_structured_requests_are_spread_evenly():
    assert workloads.constrained_ids(256, 0.25) == list(range(0, 256, 4))
    assert workloads.constrained_ids(256, 1.0) == list(range(256))
    assert workloads.constrained_ids(10, 0.3) == [0, 3, 6]
    reqs = workloads.structured(workloads.throughput(8), SMALL_SCHEMA, 0.5)
    assert [r.json_schema is not None for r in reqs] == [True, False] * 4
    outs = [type("Out", (), {"token_ids": [0] * (i + 1)})() for i in range(8)]
    same = workloads.same_lengths(reqs, outs)
    assert [r.max_tokens for r in same] == list(range(1, 9)) and all(r.json_schema is None for r in same)
    assert [r.prompt for r in same] == [r.prompt for r in reqs]


def test_random_model_tokenizer_spells_json_for_the_engines_grammar(tmp_path):
    from transformers import AutoTokenizer

    from turnout.bench.random_models import write_tokenizer
    from turnout.structured_outputs import StructuredOutputsParams
    from turnout.structured_outputs.manager import StructuredOutputManager

    write_tokenizer(tmp_path, 512)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.convert_ids_to_tokens([0, 2, 3, 416, 417, 511]) == ["<unk>", "</s>", "w3", "w416", " ", "~"]
    text = '{"id": 7, "text": "w3"}'
    ids = [417 + ord(c) - 32 for c in text]
    assert tok.decode(ids) == text and tok.decode([3, 4]) == "w3w4"  # the tokens' strings, joined
    so = StructuredOutputManager("auto", tok, 512, [2])
    assert so.compile(StructuredOutputsParams(json=workloads.JSON_SCHEMA)) is not None


def test_a_random_model_made_before_gets_a_tokenizer_that_spells_json(tmp_path):
    from turnout.bench.random_models import make_random_model

    path = make_tiny_model(tmp_path, "qwen3")  # "w{i}" tokens only, as random models had
    weights = (path / "model.safetensors").read_bytes()
    assert "{" not in json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert make_random_model(path, "qwen3-0.6b") == path
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab["{"] == 512 - 95 + ord("{") - 32 and vocab["w3"] == 3 and len(vocab) == 512
    assert (path / "model.safetensors").read_bytes() == weights


@pytest.mark.slow
def test_structured_bench_writes_its_cost_per_ratio(json_model, cpu_ceiling, tmp_path, capsys):
    schema, out = tmp_path / "schema.json", tmp_path / "r.json"
    schema.write_text(json.dumps(SMALL_SCHEMA))
    argv = ["bench", "structured", "--model", str(json_model), "--max-model-len", "256", "--num-prompts", "8",
            "--max-input-len", "16", "--max-output-len", "64", "--json-schema", str(schema),
            "--structured-output-ratio", "1,0.25", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "floor first at 1 held" in capsys.readouterr().out
    recs = json.loads(out.read_text())
    assert [(r["structured_output_ratio"], r["num_constrained"]) for r in recs] == [(1.0, 8), (0.25, 2)]
    for r in recs:
        records.check(r)
        c, u = r["output_tokens_per_s"], r["unconstrained_output_tokens_per_s"]
        assert r["structured_cost"] == pytest.approx(1 - c / u) and r["run"] == "first"
        assert r["mean_output_len"] == r["output_tokens"] / 8 and r["num_completed"] == r["num_constrained"]
        assert r["output_tokens"] / r["floor_s"] == pytest.approx(r["floor_output_tokens_per_s"])
        assert r["over_floor"] == pytest.approx(r["seconds"] / r["floor_s"])
        assert r["unconstrained_over_floor"] == pytest.approx(r["unconstrained_seconds"] / r["floor_s"])
        cfg = r["config"]
        assert cfg["engine"]["enable_prefix_caching"] is False and cfg["workload"]["schema"] == SMALL_SCHEMA


@pytest.mark.slow
def test_structured_outputs_validate_and_the_unconstrained_run_matches_their_lengths(json_model):
    import jsonschema

    from turnout import LLM

    llm = LLM(str(json_model), max_model_len=256, enable_prefix_caching=False)
    try:
        reqs = workloads.structured(workloads.throughput(8, 16, 64), SMALL_SCHEMA, 0.5)
        (_, outs), (_, plain) = workloads.structured_pair(llm, reqs)
    finally:
        llm.shutdown()
    for r, o in zip(reqs, outs):
        if r.json_schema is not None:
            assert o.finish_reason == "stop" and len(o.token_ids) < 64
            jsonschema.validate(json.loads(o.text), SMALL_SCHEMA)
        else:
            assert len(o.token_ids) == 64
    assert [len(o.token_ids) for o in plain] == [len(o.token_ids) for o in outs]


def _beside(peer: str, workload: str, model: str, opts: list[str], out: Path) -> dict[tuple[str, str], dict]:
    """`turnout bench WORKLOAD` beside one of turnout's own variants: the records by (engine, run), each
    checked, turnout's and the peer's first run and repeat."""
    argv = ["bench", workload, "--model", model, "--max-model-len", "256", *opts]
    assert main([*argv, "--peers", peer, "--out", str(out)]) == 0
    recs = {(r["engine"], r["run"]): r for r in json.loads(out.read_text())}
    assert sorted(recs) == [(e, r) for e in ("turnout", peer) for r in ("first", "repeat")]
    for r in recs.values():
        records.check(r)
    return recs


@pytest.mark.slow
def test_turnout_static_runs_the_static_default_beside_the_measured_selection(tmp_path, monkeypatch):
    """--peers turnout-static: the same workload on turnout with tuned = off, in a process of its own;
    turnout's records carry their ratio to it. A tuning record here picks block size 32 over the static 16."""
    from turnout.config import EngineConfig
    from turnout.models.info import ModelInfo
    from turnout.platform import current_platform
    from turnout.plugins import get_plugin_manager
    from turnout.tuning import Measured, TuningRecord, save, tuning_key

    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))  # the peer's process inherits it
    model = str(make_tiny_model(tmp_path / "m", "llama", vocab_size=10240))  # nano-vllm's prompt ids fit
    default = {"attention_backend": "cpu", "cudagraph_mode": "FULL_AND_PIECEWISE",
               "max_num_batched_tokens": 4096, "block_size": 16, "async_scheduling": False}  # fmt: skip
    cands = [Measured("cpu", default, [1000.0, 1010.0]),
             Measured("cpu block=32", {**default, "block_size": 32}, [3000.0, 3010.0])]  # fmt: skip
    info, pm = ModelInfo.from_dir(model), get_plugin_manager()
    for w in ("throughput", "latency"):
        key = tuning_key(EngineConfig(model=model), info, current_platform(), pm, w)
        save(TuningRecord(key, w, "tok/s", True, default, cands, 0.03, 1.0, [], "2026-12-01"))
    sizes = ["--num-prompts", "4", "--max-input-len", "32", "--max-output-len", "4"]
    for workload, opts in (("throughput", sizes), ("latency", ["--tpot-tokens", "4", "--ttft-lens", "64"])):
        recs = _beside("turnout-static", workload, model, opts, tmp_path / f"{workload}.json")
        for run in ("first", "repeat"):
            ours, static = recs["turnout", run], recs["turnout-static", run]
            assert ours["config"]["block_size"] == 32 and static["config"]["block_size"] == 16
            assert static["config"]["engine"]["tuned"] == "off"
            if workload == "throughput":
                assert static["output_tokens"] == ours["output_tokens"] == 16
                want = ours["output_tokens_per_s"] / static["output_tokens_per_s"]
                assert ours["ratio_vs_static"] == pytest.approx(want)
            else:
                assert ours["tpot_ratio_vs_static"] == pytest.approx(ours["tpot_ms"] / static["tpot_ms"])
                assert ours["ttft_ratio_vs_static"].keys() == static["ttft_ms"].keys() == {"64"}


def test_turnout_bf16_runs_the_unquantized_weights_beside_an_fp8_run(tmp_path, monkeypatch, capsys):
    """--peers turnout-bf16: the same workload on the weights this run quantizes at load, with a 16-bit KV
    cache, in a process of its own; turnout's FP8 records carry their ratio to it."""
    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    model = str(make_tiny_model(tmp_path / "m", "llama", vocab_size=10240))  # nano-vllm's prompt ids fit
    opts = ["--num-prompts", "4", "--max-input-len", "32", "--max-output-len", "4", "--quantization", "fp8",
            "--kv-cache-dtype", "fp8"]  # fmt: skip
    recs = _beside("turnout-bf16", "throughput", model, opts, tmp_path / "r.json")
    for run in ("first", "repeat"):
        ours, bf16 = recs["turnout", run], recs["turnout-bf16", run]
        precision = lambda r: [r["config"]["engine"][k] for k in ("model", "quantization", "kv_cache_dtype")]  # noqa: E731
        assert precision(ours) == [model, "fp8", "fp8"] and precision(bf16) == [model, None, "auto"]
        assert ours["output_tokens"] == bf16["output_tokens"] == 16
        assert ours["ratio_vs_bf16"] == pytest.approx(
            ours["output_tokens_per_s"] / bf16["output_tokens_per_s"]
        )
    assert "x bf16" in capsys.readouterr().out


def test_turnout_bf16_finds_a_random_fp8_models_bf16_checkpoint_and_refuses_where_there_is_none(
    tmp_path, monkeypatch
):
    from turnout.bench import random_models
    from turnout.bench.runner import Bench

    monkeypatch.setenv("TURNOUT_CACHE_DIR", str(tmp_path / "cache"))
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)  # fmt: skip
    monkeypatch.setitem(random_models.SHAPES, "tiny", ("qwen3", shape))
    args = build_parser().parse_args(
        ["bench", "throughput", "--peers", "turnout-bf16", "--quantization", "fp8"]
    )
    args.random_model = "tiny-fp8-dynamic"  # argparse's choices hold the real shapes only
    bench = Bench(args, ["turnout-bf16"])
    cfg = bench.variant_config("turnout-bf16")
    assert cfg["model"] == str(random_models.random_model_dir("tiny")) and cfg["quantization"] is None
    # vLLM reads a quantized checkpoint's own quantization_config, whatever --quantization says
    assert bench.vllm_precision() == {"quantization": None, "kv_cache_dtype": "auto"}
    bf16_config = json.loads((random_models.random_model_dir("tiny") / "config.json").read_text())
    assert "quantization_config" not in bf16_config  # the bf16 checkpoint the FP8 one was made from
    fp8 = str(random_models.random_model_dir("tiny-fp8-dynamic"))
    for argv, why in (
        (["--model", fp8], "is a quantized checkpoint, with no unquantized one beside it"),
        (["--model", str(random_models.random_model_dir("tiny"))], "this run is unquantized already"),
    ):
        args = build_parser().parse_args(["bench", "throughput", *argv, "--peers", "turnout-bf16"])
        with pytest.raises(TurnoutError, match=why) as e:
            Bench(args, ["turnout-bf16"])
        assert len(str(e.value).splitlines()) == 1
    bf16 = str(random_models.random_model_dir("tiny"))
    args = build_parser().parse_args(["bench", "throughput", "--model", bf16, "--quantization", "fp8"])
    assert Bench(args, []).vllm_precision() == {"quantization": "fp8", "kv_cache_dtype": "auto"}


def test_wide_records_and_every_engines_time_over_the_floor_reach_the_report(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import report

    base = dict(workload="wide", model="random-qwen3-8b", device="NVIDIA H200", commit="c", command="x",
                date="2026-12-04T00:00:00+00:00", num_prompts=1024)  # fmt: skip
    floor = dict(floor_s=10.0, floor_output_tokens_per_s=40_000.0)
    cfg = {"attention": "triton", "graph_mode": "FULL_AND_PIECEWISE", "dtype": "bfloat16"}
    recs = [
        {**base, "engine": "turnout", "run": "first", "config": cfg, "output_tokens_per_s": 16_000.0,
         "seconds": 25.0, "ratio_vs_vllm": 0.8, **floor, "over_floor": 2.5},
        {**base, "engine": "turnout", "run": "repeat", "config": cfg, "output_tokens_per_s": 17_000.0,
         "seconds": 23.5, "ratio_vs_vllm": 0.85, **floor, "over_floor": 40_000 / 17_000},
        {**base, "engine": "vllm", "run": "first", "config": {"version": "0.26.0"},
         "output_tokens_per_s": 20_000.0, **floor, "over_floor": 2.0},
        {**base, "engine": "vllm", "run": "repeat", "config": {"version": "0.26.0"},
         "output_tokens_per_s": 20_000.0},  # a peer's record without its floor: turnout's run's floor
    ]  # fmt: skip
    for r in recs:
        records.check(r)
    folder = tmp_path / "benchmarks/results/wide"
    folder.mkdir(parents=True)
    (folder / "2026-12-04-0000-h200-wide-triton.json").write_text(json.dumps(recs))
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "benchmarks/results")
    text = "\n".join(report.bench_section("wide"))
    assert "| engine | run | requests | output tok/s | seconds | x vLLM | floor (s) | x floor |" in text
    assert "| turnout | first | 1,024 | 16,000 | 25 | 0.8 | 10 | 2.5 |" in text
    assert "| vllm | first | 1,024 | 20,000 | - | - | 10 | 2 |" in text
    assert "| vllm | repeat | 1,024 | 20,000 | - | - | - | 2 |" in text
    assert "Roofline floor: 40,000 output tok/s." in text and "x floor: each engine's time over" in text
    (line,) = [x for x in report.vllm_headline() if "random-qwen3-8b" in x]
    assert "wide decode 0.80x and 0.85x vLLM's, its first run 2.50x the floor's time" in line


def test_a_record_folder_gets_a_name_of_plain_characters(tmp_path):
    """A per-phase pair's "+" and a device's spaces become "-" in the file name records.write picks."""
    results = Path(__file__).parents[1] / "benchmarks/results/wide"
    recs = json.loads((results / "2026-12-06-0404-h100-wide-qwen3-8b-default.json").read_text())
    first = records.write(recs, tmp_path, "wide", "NVIDIA H100 80GB HBM3")
    again = records.write(recs, tmp_path, "wide", "NVIDIA H100 80GB HBM3")
    stem = first.name.removesuffix(".json")
    assert stem[16:] == "h100-80gb-hbm3-wide-triton-flash_attn-async" and again.name == f"{stem}-2.json"
    assert json.loads(first.read_text()) == recs


def test_counted_run_reports_the_runs_preemptions_and_kv_blocks(tiny_qwen3):
    """A cache of 26 four-token blocks for six requests growing to 99 tokens preempts some: the record counts
    this run's preemptions alone (the engine's counter minus its value before) and the cache's blocks."""
    from turnout import LLM
    from turnout.bench.runner import counted_run

    small = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=6, num_gpu_blocks_override=26)
    llm = LLM(str(tiny_qwen3), attention_backend="cpu", max_model_len=104, **small)
    reqs = [workloads.Req([7 + i] * (4 + i), max_tokens=90) for i in range(6)]
    first = counted_run(llm, reqs)
    total = llm.engine.stats()["preemptions"]
    second = counted_run(llm, reqs)
    assert first["num_preemptions"] == total > 0 and first["num_gpu_blocks"] == 26
    assert second["num_preemptions"] == llm.engine.stats()["preemptions"] - total > 0
