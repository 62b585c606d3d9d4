"""KV-cache specs and groups: layers grouped by spec over one block pool, sliding-window blocks freed while
a request decodes (and HF's greedy tokens unchanged, on the cpu backend and on Triton's in the
interpreter), window-aware prefix hits equal to a run without the cache, the KV memory a Gemma-3-like
model needs at a 32k context, and a backend that serves full attention only refused for a windowed model."""

from __future__ import annotations

import json
import random
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from turnout import LLM, SamplingParams
from turnout.attention import (
    LAYER_FEATURES,
    AttentionBackend,
    AttentionImpl,
    AttentionLayerSpec,
    AttentionSpec,
)
from turnout.attention.kv_spec import NULL_BLOCK, FullAttentionSpec, SlidingWindowSpec, kv_cache_config
from turnout.engine.block_manager import BlockManager
from turnout.engine.request import Request
from turnout.engine.scheduler import Scheduler
from turnout.errors import SelectionError
from turnout.worker import kv_cache

from tiny_models import TOKENIZER_VOCAB, checkpoints, hf_greedy, save_random_model, write_tokenizer

WINDOW, BLOCK, MAX_NEW = 8, 4, 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
KW = {"dtype": "float32", "cpu_kv_cache_bytes": 1 << 22, "block_size": BLOCK}
COMMON = dict(
    vocab_size=TOKENIZER_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
    tie_word_embeddings=False, intermediate_size=128,
)  # fmt: skip
CONFIGS = {  # Gemma 2: sliding, full, sliding; Gemma 3: five local layers, one global
    "mistral": ("MistralConfig", dict(num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=6, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention"] * 5 + ["full_attention"])),
}  # fmt: skip
GROUPS = {"mistral": ["sliding_window"], "gemma2": ["sliding_window", "sliding_window", "full"],
          "gemma3": ["sliding_window"] * 5 + ["full"]}  # fmt: skip
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, TOKENIZER_VOCAB) for _ in range(_rng.randrange(14, 40))] for _ in range(5)]


def _write(path: Path, case: str) -> Path:
    import transformers

    cls, own = CONFIGS[case]
    save_random_model(path, getattr(transformers, cls)(**COMMON, **own), wide_norms=case.startswith("gemma"))
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint(case) -> (its tiny checkpoint, HF's greedy tokens for PROMPTS)."""
    reference = lambda path: hf_greedy(path, PROMPTS, MAX_NEW, attn_implementation="eager")  # noqa: E731
    return checkpoints(tmp_path_factory.mktemp, _write, reference)


def _decode_frees_blocks(
    llm: LLM, prompt: list[int], params: SamplingParams = GREEDY
) -> tuple[list[int], list[int]]:
    """Step one request to its end: its tokens, and the pool's free blocks after each step. While it
    decodes, each windowed group holds at most the blocks its window reaches."""
    engine = llm.engine
    bm = engine.scheduler.bm
    req = engine.add_request(prompt, params)
    free = []
    while engine.has_unfinished():
        engine.step()
        free.append(bm.num_free_blocks)
        for g in bm.windowed if len(req.output_token_ids) > 1 and not req.is_finished else ():
            held = [b for b in req.block_ids[g] if b != NULL_BLOCK]
            assert len(held) <= -(-WINDOW // BLOCK) + 2 < len(req.block_ids[g]), req.block_ids[g]
    return req.output_token_ids, free


@pytest.mark.parametrize("case", list(CONFIGS))
def test_sliding_blocks_are_freed_and_tokens_match_hf(checkpoint, case: str) -> None:
    """Batched, alone with prefix hits, chunked (tiny_models' harness, inline), and one request stepped:
    its free-block count rises while it decodes, and its tokens are HF's."""
    path, ref = checkpoint(case)
    llm = LLM(str(path), **KW)
    assert [s.kind for s in llm.engine.kv_cache_config.specs] == GROUPS[case]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref
    for p, r in zip(PROMPTS, ref):
        out = llm.generate([p], GREEDY, use_tqdm=False)[0]
        assert out.token_ids == r and out.num_cached_tokens >= len(p) - BLOCK, out.num_cached_tokens
    tokens, free = _decode_frees_blocks(llm, PROMPTS[-1] + [5])
    assert tokens == hf_greedy(path, [PROMPTS[-1] + [5]], MAX_NEW, attn_implementation="eager")[0]
    assert any(b > a for a, b in zip(free[:-1], free[1:-1])), free  # risen before the request ended
    chunked = LLM(str(path), max_num_batched_tokens=16, max_num_seqs=4, **KW)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY, use_tqdm=False)] == ref
    for engine in (llm.engine, chunked.engine):  # every block back, NULL_BLOCK not counted as held
        stats = engine.stats()
        assert stats["free_blocks"] == stats["total_blocks"], stats


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The triton backend off CUDA in Triton's interpreter (conftest imports triton under it)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        import importlib

        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(importlib.import_module("triton.language").cdiv, InterpretedFunction):
            pytest.skip("triton was first imported without TRITON_INTERPRET=1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("case", ["gemma2", "mistral"])
@pytest.mark.slow
def test_triton_in_the_interpreter_frees_blocks_and_matches_hf(checkpoint, triton_interpreter, case) -> None:
    """The Triton kernels over tables with NULL_BLOCK in place of freed blocks, chunked, then a prefix hit."""
    path, ref = checkpoint(case)
    llm = LLM(str(path), max_num_batched_tokens=16, attention_backend="triton", **KW)
    assert llm.selection.attention.chosen.name == "triton"
    twelve = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens, free = _decode_frees_blocks(llm, PROMPTS[1], twelve)
    assert tokens == ref[1][:12] and any(b > a for a, b in zip(free[:-1], free[1:-1])), free
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], twelve, use_tqdm=False)
    assert [o.token_ids for o in outs] == [ref[0][:12], ref[1][:12]]
    assert outs[1].num_cached_tokens > WINDOW


@pytest.mark.parametrize("case", ["gemma3", "mistral"])
def test_window_aware_prefix_hits_equal_a_run_without_the_cache(checkpoint, case: str) -> None:
    """Prompts that share a prefix longer than the window, decoded past it: the second round hits the
    cache and gives the tokens of an engine without one."""
    path, _ = checkpoint(case)
    shared = PROMPTS[0] + PROMPTS[1]
    prompts = [shared + [7 + i] * (i + 1) for i in range(4)]
    plain = LLM(str(path), enable_prefix_caching=False, **KW)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(path), **KW)
    assert _decode_frees_blocks(llm, prompts[0])[0] == want[0]  # its early local blocks leave the window
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == want
    assert all(o.num_cached_tokens >= len(shared) - BLOCK for o in again), [
        o.num_cached_tokens for o in again
    ]


def test_a_hit_needs_only_the_window_of_its_last_token() -> None:
    """A full group and a windowed one: the windowed group's early blocks, freed and then taken by another
    request, are not needed for a hit; the hit holds NULL_BLOCK there and the full group's blocks."""
    specs = (
        FullAttentionSpec(BLOCK, 1, 8, torch.float32),
        SlidingWindowSpec(BLOCK, 1, 8, torch.float32, WINDOW),
    )
    bm = BlockManager(num_blocks=20, block_size=BLOCK, kv_cache_specs=specs)
    sp = SamplingParams(max_tokens=4)
    a = Request("a", list(range(3, 27)), sp)  # 24 tokens: 6 blocks
    assert bm.allocate(a, 24)
    a.num_computed_tokens = 24
    bm.cache_full_blocks(a)
    assert bm.allocate(a, 1)  # the next token: blocks before its window go back to the pool
    assert a.block_ids[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in a.block_ids[0]
    b = Request("b", list(range(100, 120)), sp)  # takes every free block: the freed ones are evicted
    assert bm.allocate(b, 4 * (bm.num_free_blocks // 2))
    hit = bm.find_cached(Request("c", list(range(3, 27)) + [1], sp))
    assert len(hit[0]) == 6 and hit[0] == a.block_ids[0][:6]
    assert hit[1][:4] == [NULL_BLOCK] * 4 and hit[1][4:] == a.block_ids[1][4:6]


def test_a_hit_in_several_groups_never_gives_one_block_to_two_groups() -> None:
    """The cached blocks of every group are taken off the free queue before any group takes new blocks:
    a group's new block never evicts (and so shares) a block another group's hit holds."""
    specs = (
        SlidingWindowSpec(BLOCK, 1, 8, torch.float32, 64),
        FullAttentionSpec(BLOCK, 1, 8, torch.float32),
    )
    bm = BlockManager(num_blocks=11, block_size=BLOCK, kv_cache_specs=specs)  # 10 blocks and NULL_BLOCK
    sp = SamplingParams(max_tokens=4)
    a, d = Request("a", list(range(3, 13)), sp), Request("d", list(range(50, 58)), sp)
    for r in (a, d):  # a: 3 blocks a group, d: 2; the pool is then empty
        assert bm.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    bm.free_request(a)
    bm.free_request(d)
    b = Request("b", list(range(3, 11)) + list(range(70, 82)), sp)  # a's first 2 blocks, then 3 more
    hit = bm.find_cached(b)
    assert [len(ids) for ids in hit] == [2, 2]
    assert bm.allocate(b, b.num_tokens - 2 * BLOCK, hit)
    held = [i for ids in b.block_ids for i in ids]
    assert len(held) == len(set(held)) == 10, b.block_ids
    assert all(bm.blocks[i].ref_count == 1 for i in held) and bm.num_free_blocks == 0


def test_a_freed_request_is_evicted_from_its_tail_in_every_group() -> None:
    """free_request queues every group's block at a position together, tail first: a new request that
    evicts two blocks takes the last position's, and the freed prefix's first two blocks still hit in both
    groups."""
    specs = (
        SlidingWindowSpec(BLOCK, 1, 8, torch.float32, 64),
        FullAttentionSpec(BLOCK, 1, 8, torch.float32),
    )
    bm = BlockManager(num_blocks=7, block_size=BLOCK, kv_cache_specs=specs)  # 6 blocks and NULL_BLOCK
    sp = SamplingParams(max_tokens=4)
    a = Request("a", list(range(3, 15)), sp)  # 3 full blocks a group: the whole pool
    assert bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    bm.free_request(a)
    assert bm.num_free_blocks == bm.num_pool_blocks == 6
    assert bm.allocate(Request("b", [1, 2], sp), 2)  # one block a group, evicted from the free queue
    hit = bm.find_cached(Request("c", list(range(3, 11)) + [1], sp))
    assert [len(ids) for ids in hit] == [2, 2], hit


def _assert_accounted(bm: BlockManager, reqs: list[Request]) -> None:
    """Each held block is in one group and its ref_count is its holders; the rest of the pool is free."""
    held, group = Counter(), {}
    for r in reqs:
        for g, ids in enumerate(r.block_ids):
            for b in ids:
                if b != bm.null:
                    held[b] += 1
                    assert group.setdefault(b, g) == g, (b, r.req_id, r.block_ids)
    assert all(bm.blocks[b].ref_count == n and b not in bm.free for b, n in held.items())
    assert all(bm.blocks[b].ref_count == 0 for b in bm.free)
    assert len(held) + bm.num_free_blocks == bm.num_pool_blocks


@pytest.mark.parametrize(("windows", "num_blocks"), [((6, None), 29), ((6, 6, None), 43), ((5,), 9)])
def test_blocks_stay_accounted_through_preemption_abort_and_prefix_hits(windows, num_blocks: int) -> None:
    """Requests sharing prefixes over a pool too small for them all (but for the longest alone), chunked,
    preempted and some aborted, with one step in flight (async scheduling): after every step each group's
    blocks are accounted for."""
    specs = tuple(
        SlidingWindowSpec(BLOCK, 1, 8, torch.float32, w)
        if w
        else FullAttentionSpec(BLOCK, 1, 8, torch.float32)
        for w in windows
    )
    preempted = 0
    for seed in range(30):
        rng = random.Random(seed)
        bm = BlockManager(num_blocks=num_blocks, block_size=BLOCK, kv_cache_specs=specs)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=200)
        shared = [rng.randrange(3, 50) for _ in range(40)]
        reqs = {}
        for i in range(12):
            prompt = shared[: rng.randrange(5, 40)] + [rng.randrange(3, 50) for _ in range(rng.randrange(10))]
            sp = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=True)
            reqs[str(i)] = r = Request(str(i), prompt, sp)
            sched.add(r)
        in_flight = None
        while sched.has_unfinished() or in_flight:
            out = sched.schedule()
            if in_flight is not None:
                sched.update(
                    in_flight, {s.req_id: rng.randrange(3, 50) for s in in_flight.requests if s.sample}, reqs
                )
            in_flight = out if out.requests else None
            if sched.running and rng.random() < 0.05:
                sched.finish(rng.choice(sched.running), "abort")
            _assert_accounted(bm, [r for r in reqs.values() if not r.is_finished])
        assert bm.num_free_blocks == bm.num_pool_blocks
        preempted += sched.num_preemptions
    assert preempted > 0


def _gemma3_like(window: int | None) -> AttentionSpec:
    """Gemma 3's KV shape: five local layers of `window` per global layer, 48 layers, 8 KV heads of 256."""
    layers = tuple(AttentionLayerSpec(i, 0.0625, window if i % 6 != 5 else None) for i in range(48))
    return AttentionSpec(16, 8, 256, torch.bfloat16, 16, 0.0625, 48, layers)


def test_gemma3_like_kv_memory_at_32k_is_under_a_third_of_full_attention() -> None:
    """Bytes a 32k-token request holds, through the sizing the engine uses (groups, tensors, the backend's
    layout): at most 0.3x full attention in every layer, decoding and in 2,048-token chunks; and the
    same pool holds a request that many times longer."""
    sizes = {}
    for window in (1024, None):
        spec = _gemma3_like(window)
        config = kv_cache_config([spec.kv_cache_specs()])
        sizes[window] = [kv_cache.kv_bytes_for_tokens(spec, config, 32768, c) for c in (None, 2048)]
        blocks = int((1 << 33) // kv_cache.kv_bytes_per_block(spec, config.group_size))
        sizes[window] += [config.max_tokens(blocks, 2048), config.max_concurrency(blocks, 32768, 2048)]
    (decode, chunked, longest, fit), (full_decode, full_chunked, full_longest, full_fit) = (
        sizes[1024],
        sizes[None],
    )
    assert full_decode == full_chunked == 48 * 2 * 32768 * 8 * 256 * 2  # 48 layers of K and V in bf16
    assert decode <= 0.3 * full_decode and chunked <= 0.3 * full_chunked, (decode, chunked, full_decode)
    assert longest >= 3 * full_longest, (longest, full_longest)
    # full attention: every layer holds ceil(32768 / 16) blocks; each block id spans the 48 layers' tensors
    assert full_fit == blocks / (32768 // 16) and fit >= 3 * full_fit, (fit, full_fit)


def test_groups_share_tensors_slot_wise() -> None:
    """Gemma 2's 1:1 layers form two groups over one set of tensors; a spec with more layers than the
    fewest forms several groups."""
    full, slide = (
        FullAttentionSpec(16, 2, 64, torch.bfloat16),
        SlidingWindowSpec(16, 2, 64, torch.bfloat16, 64),
    )
    config = kv_cache_config([[slide, full] * 3])
    assert [(g.spec.kind, g.layer_ids) for g in config.groups] == [
        ("sliding_window", (0, 2, 4)),
        ("full", (1, 3, 5)),
    ]
    assert config.group_size == 3 and config.placement(0) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    config = kv_cache_config([[slide] * 5 + [full]])
    assert config.group_size == 1 and [s.kind for s in config.specs] == ["sliding_window"] * 5 + ["full"]
    staged = kv_cache_config([[slide, full], [slide]])  # two pipeline stages
    assert staged.placement(1) == [(1, 0)] and staged.placement(0) == [(0, 0), (2, 0)]
    assert kv_cache_config([[full] * 4]).groups[0].layer_ids == (0, 1, 2, 3)


FULL_ONLY = """
import torch
import turnout
from turnout.attention import LAYER_FEATURES, AttentionBackend


class FullOnly(AttentionBackend):
    name = "fullonly"
    device_types = ("cpu",)
    dtypes = (torch.float32,)
    attention_features = frozenset(LAYER_FEATURES)  # windows in its kernel, but no freed blocks

    def forward(self, q, k, v, kv_cache, meta, layer=None):
        raise NotImplementedError


@turnout.hookimpl
def turnout_attention_backends(platform):
    return [FullOnly()]
"""


def test_a_backend_without_the_sliding_spec_is_refused_with_its_reason(
    checkpoint, register_plugin, plugin_manager, capsys
) -> None:
    """Selection and explain give the reason; explain also lists the KV-cache groups."""
    from turnout.cli import main

    module = types.ModuleType("fullonly_plugin")
    exec(FULL_ONLY, module.__dict__)
    register_plugin(module, "fullonly_plugin")
    path, _ = checkpoint("gemma2")
    with pytest.raises(SelectionError, match="KV-cache spec sliding_window unsupported \\(serves full\\)"):
        LLM(str(path), attention_backend="fullonly", **KW)
    assert main(["explain", "--model", str(path), "--dtype", "float32", "--block-size", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = [c for c in doc["kinds"]["attention"]["candidates"] if c["name"] == "fullonly"]
    assert "KV-cache spec sliding_window unsupported (serves full)" in row["reasons"]
    local = {"kind": "sliding_window", "sliding_window": WINDOW, "num_layers": 1}
    assert doc["kv_cache_groups"] == [local, local, {"kind": "full", "sliding_window": None, "num_layers": 1}]
    assert main(["explain", "--model", str(path), "--dtype", "float32"]) == 0
    local = f"sliding_window {WINDOW} (1 layers)"
    line = f"KV-cache groups: {local}; {local}; full (1 layers)"
    assert line in capsys.readouterr().out


def test_backends_declare_the_specs_they_serve() -> None:
    from turnout_cpu.backend import CPUAttentionBackend
    from turnout_flash_attn.backend import FlashAttnBackend
    from turnout_flashinfer.backend import FlashInferBackend
    from turnout_triton.backend import TritonAttentionBackend

    every = ("full", "sliding_window", "mla")
    assert CPUAttentionBackend.kv_cache_specs == TritonAttentionBackend.kv_cache_specs == every
    assert FlashInferBackend.kv_cache_specs == FlashAttnBackend.kv_cache_specs == ("full",)
    with pytest.raises(TypeError, match="unknown kv_cache_specs"):
        type("Bad", (AttentionBackend,), {"name": "bad", "device_types": ("cpu",), "dtypes": (torch.float32,),
                                          "kv_cache_specs": ("latent",), "impl_cls": AttentionImpl,
                                          "attention_features": frozenset(LAYER_FEATURES)})  # fmt: skip
