"""Sampler tests against exact float64 references computed here, independently of the sampler's helpers."""

from __future__ import annotations

import math
import random
import time
from collections import Counter

import pytest
import torch

from turnout.sampling_params import SamplingParams as SP
from turnout.structured_outputs import apply_token_bitmask, bitmask_words
from turnout.worker.sampler import Sampler, SamplerOutput

sampler = Sampler()
NEG = -math.inf


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)


def run(
    logits: torch.Tensor,
    params: list[SP],
    gens: list[torch.Generator | None] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplerOutput:
    B = logits.shape[0]
    empty = [[] for _ in range(B)]
    return sampler(logits, params, gens or [None] * B, prompts or empty, outputs or empty)


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ---- float64 references (plain Python) ----


def softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v > NEG else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_probs(logits: list[float], T: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """Filtered, renormalised distribution, and the closest any top-p / min-p test came to its boundary."""
    x = [v / T for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    margin = math.inf
    if 0 < top_k < len(x):
        for i in order[top_k:]:
            x[i] = NEG
    if top_p < 1:
        p, mass = softmax(x), 0.0
        for i in order:
            margin = min(margin, abs(mass - top_p))
            if mass >= top_p:
                x[i] = NEG
            mass += p[i]
    if min_p > 0:
        p = softmax(x)
        for i, pi in enumerate(p):
            if pi > 0:
                margin = min(margin, abs(pi / max(p) - min_p))
                if pi < min_p * max(p):
                    x[i] = NEG
    return softmax(x), margin


def ref_penalised(logits: list[float], sp: SP, prompt: list[int], output: list[int]) -> list[float]:
    x = list(logits)
    seen, counts = set(prompt) | set(output), Counter(output)
    for t in seen:
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t, c in counts.items():
        x[t] -= sp.presence_penalty + sp.frequency_penalty * c
    return x


def check_freq(tokens: list[int], p: list[float]) -> None:
    """Empirical frequencies of `tokens` match p: TV below E[TV] bound + McDiarmid deviation at delta=1e-6."""
    n, V = len(tokens), len(p)
    counts = Counter(tokens)
    assert all(p[t] > 0 for t in counts), f"drew outside the support: {sorted(counts)} vs {p}"
    assert all(counts[i] > 0 for i in range(V) if p[i] * n > 30), "a well-supported token was never drawn"
    tv = 0.5 * sum(abs(counts[i] / n - p[i]) for i in range(V))
    bound = 0.5 * math.sqrt(V / n) + math.sqrt(math.log(1e6) / (2 * n))
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


def draw(logits: torch.Tensor, sp: SP, n: int, device: str = "cpu") -> list[int]:
    """n independent draws for one row: the row repeated n times in one batched call."""
    return run(logits.to(device).expand(n, -1).contiguous(), [sp] * n).token_ids


# ---- tests ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = (torch.randn(64, 1000) * 3).to(dtype)
    out = run(logits, [SP(temperature=0)] * 64)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


FILTERS = [
    dict(T=1.0),
    dict(T=0.5),
    dict(T=2.5),
    dict(T=1.0, top_k=3),
    dict(T=0.7, top_k=6),
    dict(T=1.0, top_k=40),  # >= V: off
    dict(T=1.0, top_p=0.55),
    dict(T=1.6, top_p=0.83),
    dict(T=1.0, min_p=0.12),
    dict(T=0.8, min_p=0.3),
    dict(T=1.3, top_k=4, top_p=0.8),  # top-p on the renormalised top-k distribution: 3 tokens, not 4
    dict(T=0.9, top_k=10, top_p=0.9, min_p=0.07),
]


@pytest.mark.parametrize("f", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filter_frequencies(f: dict) -> None:
    V, n = 12, 100_000
    logits = torch.randn(V, generator=gen(7)) * 1.5
    p, margin = ref_probs(logits.tolist(), **f)
    assert margin > 1e-3, "test case too close to a top-p / min-p boundary"
    sp = SP(temperature=f["T"], top_k=f.get("top_k", 0), top_p=f.get("top_p", 1.0), min_p=f.get("min_p", 0.0))
    check_freq(draw(logits, sp, n), p)


def test_top_p_keeps_boundary_token() -> None:
    # p = [0.5, 0.3, 0.2]: top_p=0.5 keeps only token 0 (mass reached); 0.51 must also keep token 1.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert set(draw(logits, SP(top_p=0.5), 5000)) == {0}
    assert set(draw(logits, SP(top_p=0.51), 5000)) == {0, 1}
    assert set(draw(logits, SP(top_p=0.01, top_k=2), 5000)) == {0}  # top token always kept


def test_seeded_rows_frequencies() -> None:
    # each row its own generator: the per-row draws must follow the same distribution
    V, n = 10, 20_000
    logits = torch.randn(V, generator=gen(3))
    p, _ = ref_probs(logits.tolist(), T=0.9, top_k=7)
    gens = [gen(s) for s in range(n)]
    out = run(logits.expand(n, -1).contiguous(), [SP(temperature=0.9, top_k=7, seed=1)] * n, gens)
    check_freq(out.token_ids, p)


def test_seeded_reproducible_and_batch_independent() -> None:
    V, steps = 500, 8
    sp = SP(temperature=1.0, top_p=0.9, seed=1234)
    logits = [torch.randn(1, V) for _ in range(steps)]

    def alone(seed: int) -> list[int]:
        g = gen(seed)
        return [run(x, [sp], [g]).token_ids[0] for x in logits]

    others = [SP(temperature=0), SP(top_k=5), SP(temperature=0.7, min_p=0.2), SP(top_p=0.5)]
    g, og = gen(1234), [None, gen(9), None, gen(10)]
    batched = []
    for x in logits:
        batch = torch.cat([torch.randn(2, V), x, torch.randn(2, V)])
        out = run(batch, others[:2] + [sp] + others[2:], og[:2] + [g] + og[2:])
        batched.append(out.token_ids[2])
    a = alone(1234)
    assert a == alone(1234) == batched
    assert a != alone(4321)


def test_penalties_match_reference_greedy() -> None:
    B, V = 96, 60
    logits = torch.randn(B, V) * 2
    params, prompts, outputs = [], [], []
    for i in range(B):
        kind = i % 4  # rep only, presence only, frequency only, all three
        params.append(
            SP(
                temperature=0,
                repetition_penalty=random.uniform(1.2, 3.0) if kind in (0, 3) else 1.0,
                presence_penalty=random.uniform(-1, 2) if kind in (1, 3) else 0.0,
                frequency_penalty=random.uniform(-0.5, 1.0) if kind in (2, 3) else 0.0,
            )
        )
        prompts.append(random.choices(range(V), k=random.randint(0, 30)))
        top = [int(logits[i].argmax())] * random.randint(0, 3)  # penalise the raw argmax in most rows
        outputs.append(random.choices(range(V // 2), k=random.randint(0, 20)) + top)  # repeats: counts > 1
    ref = [ref_penalised(logits[i].double().tolist(), params[i], prompts[i], outputs[i]) for i in range(B)]
    expect = [max(range(V), key=r.__getitem__) for r in ref]
    for r in ref:  # no near-ties: float32 vs float64 must agree
        a, b = sorted(r)[-2:]
        assert b - a > 1e-4
    out = run(logits, params, None, prompts, outputs)
    assert out.token_ids == expect
    changed = Counter(i % 4 for i, a in enumerate(logits.argmax(-1).tolist()) if a != expect[i])
    assert all(changed[k] >= 3 for k in range(4)), (
        changed
    )  # each penalty moves the argmax: the test has teeth


def test_penalties_then_temperature_frequencies() -> None:
    V, n = 10, 100_000
    logits = torch.randn(V, generator=gen(5)) * 1.5
    sp = SP(temperature=0.8, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.3, top_k=8)
    prompt, output = [0, 1, 2, 2], [2, 3, 3, 3, 4]
    pen = ref_penalised(logits.double().tolist(), sp, prompt, output)
    p, _ = ref_probs(pen, T=0.8, top_k=8)
    out = run(logits.expand(n, -1).contiguous(), [sp] * n, None, [prompt] * n, [output] * n)
    check_freq(out.token_ids, p)


def test_penalties_do_not_touch_input_or_other_rows() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [
        SP(temperature=0),
        SP(temperature=0, repetition_penalty=5.0, frequency_penalty=2.0),
        SP(top_k=3),
    ]
    out = run(logits, params, None, [[0, 1]] * 3, [[logits[i].argmax().item()] * 4 for i in range(3)])
    assert torch.equal(logits, before)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] != logits[1].argmax().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_raw_distribution(dtype: torch.dtype) -> None:
    V = 300
    params = [
        SP(temperature=0, logprobs=3),
        SP(temperature=0.7, top_k=10, logprobs=0),
        SP(top_p=0.5, repetition_penalty=2.0, presence_penalty=1.0, logprobs=5),  # penalties: not in logprobs
        SP(logprobs=None),
        SP(temperature=0, logprobs=20),
        SP(min_p=0.1, logprobs=1),
    ]
    B = len(params)
    logits = (torch.randn(B, V) * 4).to(dtype)
    out = run(logits, params, None, [[1, 2, 3]] * B, [[4, 5, 5]] * B)
    ref = torch.log_softmax(logits.double(), -1)  # [B, V]
    assert out.logprobs is not None and out.top_logprobs is not None and out.ranks is not None
    for i, sp in enumerate(params):
        if sp.logprobs is None:
            continue
        chosen = ref[i, out.token_ids[i]].item()
        assert out.logprobs[i] == pytest.approx(chosen, abs=1e-4)
        assert out.ranks[i] == sum(v >= chosen - 1e-9 for v in ref[i].tolist())  # 1 = the most likely
        top = out.top_logprobs[i]
        assert len(top) == (sp.logprobs or 0)
        if top:
            expect = ref[i].topk(len(top)).values.tolist()
            assert [lp for _, lp in top] == pytest.approx(expect, abs=1e-4)
            assert all(lp == pytest.approx(ref[i, t].item(), abs=1e-4) for t, lp in top)
            assert len({t for t, _ in top}) == len(top)
    assert out.top_logprobs[4][0][0] == out.token_ids[4] or ref[4].max() - ref[4, out.token_ids[4]] < 1e-6


def test_mixed_batch_rows_behave_as_alone() -> None:
    V, steps = 400, 6
    params = [
        SP(temperature=0),
        SP(temperature=0, repetition_penalty=1.5),
        SP(top_k=20, seed=1),
        SP(top_p=0.7, seed=2),
        SP(temperature=0.8, min_p=0.1, seed=3),
        SP(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3, seed=4),
        SP(),  # global RNG
        SP(temperature=0, presence_penalty=1.5, frequency_penalty=1.0),
        SP(temperature=0.6, top_k=50, top_p=0.95, min_p=0.02, seed=5),
    ]
    B = len(params)
    prompts = [random.choices(range(V), k=12) for _ in range(B)]
    logits = [torch.randn(B, V) * 2 for _ in range(steps)]

    def go(rows: list[int]) -> list[list[int]]:
        gens = [gen(params[i].seed) if params[i].seed is not None else None for i in rows]
        outs: list[list[int]] = [[] for _ in rows]
        for x in logits:
            res = run(x[rows], [params[i] for i in rows], gens, [prompts[i] for i in rows], outs)
            outs = [o + [t] for o, t in zip(outs, res.token_ids, strict=True)]
        return outs

    batched = go(list(range(B)))
    for i, sp in enumerate(params):
        if sp.seed is not None or sp.greedy:
            assert go([i])[0] == batched[i], f"row {i} {sp}"
    assert all(0 <= t < V for t in batched[6])


def processors_sp(**kw) -> SP:
    """SamplingParams as the engine hands them over: bad words already token ids, EOS ids set."""
    bad, eos = kw.pop("bad_ids", []), kw.pop("eos", [])
    sp = SP(**kw)
    sp.bad_words_token_ids, sp.eos_token_ids = bad, eos
    return sp


def ref_banned(sp: SP, output: list[int]) -> set[int]:
    """Brute force: every bad word whose tokens but the last end the output bans its last token; EOS and
    stop tokens are banned while the output is shorter than min_tokens."""
    banned = set()
    for w in sp.bad_words_token_ids:
        k = len(w) - 1
        if len(output) >= k and (k == 0 or output[-k:] == w[:-1]):
            banned.add(w[-1])
    if len(output) < sp.min_tokens:
        banned |= set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(sp.eos_token_ids))
    return banned


def ref_processed(logits: list[float], sp: SP, prompt: list[int], output: list[int]) -> list[float]:
    x = [NEG if t in ref_banned(sp, output) else v for t, v in enumerate(logits)]
    for t, b in (sp.logit_bias or {}).items():
        x[t] += b
    return ref_penalised(x, sp, prompt, output)


def test_logit_bias_bad_words_min_tokens_greedy_match_reference() -> None:
    B, V = 64, 40
    logits = torch.randn(B, V) * 2
    params, prompts, outputs = [], [], []
    for i in range(B):
        top = logits[i].topk(3).indices.tolist()
        kind = i % 4
        params.append(
            processors_sp(
                temperature=0,
                logit_bias={top[0]: -random.uniform(3, 9), random.randrange(V): random.uniform(0, 4)}
                if kind in (0, 3)
                else None,
                bad_ids=[[top[0]], [5, top[1]], [7, 8, top[2]]] if kind in (1, 3) else [],
                min_tokens=4 if kind in (2, 3) else 0,
                eos=[top[0]],
                stop_token_ids=[top[1]] if kind == 2 else [],
                repetition_penalty=1.3 if i % 8 == 3 else 1.0,
            )
        )
        prompts.append(random.choices(range(V), k=5))
        outputs.append(random.choice([[], [5], [1, 5], [7, 8], [3, 7, 8], [1, 2, 3, 4, 5]]))
    ref = [ref_processed(logits[i].double().tolist(), params[i], prompts[i], outputs[i]) for i in range(B)]
    expect = [max(range(V), key=r.__getitem__) for r in ref]
    out = run(logits, params, None, prompts, outputs)
    assert out.token_ids == expect
    changed = sum(a != b for a, b in zip(logits.argmax(-1).tolist(), expect))
    assert changed >= B // 2  # the processors move most argmaxes: the test has teeth


def test_processors_then_sampling_frequencies() -> None:
    V, n = 10, 100_000
    logits = torch.randn(V, generator=gen(11)) * 1.5
    sp = processors_sp(
        temperature=0.9,
        top_k=7,
        logit_bias={0: 1.5, 3: -2.0, 9: 0.7},
        bad_ids=[[4], [6, 2], [8, 5]],  # 5 is banned after 8; 2 is not banned (the output ends in 1)
        min_tokens=5,
        eos=[1],
    )
    output = [3, 8]
    p, _ = ref_probs(ref_processed(logits.double().tolist(), sp, [], output), T=0.9, top_k=7)
    assert p[4] == p[5] == p[1] == 0 and p[2] > 0
    tokens = run(logits.expand(n, -1).contiguous(), [sp] * n, None, [[]] * n, [output] * n).token_ids
    check_freq(tokens, p)


def test_logprobs_are_raw_even_with_processors() -> None:
    """logit_bias and bans change what is drawn, not the reported logprobs (vLLM's raw logprobs)."""
    logits = torch.randn(2, 30)
    sp = processors_sp(temperature=0, logit_bias={3: 50.0}, bad_ids=[[int(logits[0].argmax())]], logprobs=2)
    out = run(logits, [sp, sp])
    ref = torch.log_softmax(logits.double(), -1)
    assert out.token_ids == [3, 3]
    assert out.logprobs == pytest.approx(ref[:, 3].tolist(), abs=1e-5)
    assert [t for t, _ in out.top_logprobs[0]] == ref[0].topk(2).indices.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_frequencies_and_seeds() -> None:
    V, n = 12, 100_000
    logits = torch.randn(V, generator=gen(7)) * 1.5
    f = dict(T=0.9, top_k=10, top_p=0.9, min_p=0.07)
    p, _ = ref_probs(logits.tolist(), **f)
    check_freq(draw(logits, SP(temperature=0.9, top_k=10, top_p=0.9, min_p=0.07), n, "cuda"), p)
    x = torch.randn(4, 1000, device="cuda")
    sp = [SP(top_p=0.8, seed=1), SP(temperature=0), SP(top_k=5), SP(min_p=0.1, seed=2)]
    for dev in ("cuda", "cpu"):  # a CPU generator for a CUDA row also works
        a = run(x, sp, [gen(1, dev), None, None, gen(2, dev)]).token_ids
        b = run(x[:1], sp[:1], [gen(1, dev)]).token_ids + run(x[3:], sp[3:], [gen(2, dev)]).token_ids
        assert [a[0], a[3]] == b and a[1] == x[1].argmax().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_masking_a_step_s_rows_never_waits_for_the_gpu(pinned: bool) -> None:
    """The bitmask is applied while the forward still runs: the host returns at once, with ~0.2 s of GPU
    work queued before it, and the masked logits are the reference's."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [1, 5, 6]
    logits = torch.randn(8, vocab, generator=gen)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (len(rows), bitmask_words(vocab)), dtype=torch.int32, generator=gen
    )
    want = logits.double().clone()
    for i, r in enumerate(rows):  # bit t of word t // 32, one token at a time
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu.clone(), bitmask, rows)  # the first call's set-up, untimed
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s at the H200's clock
    t = time.perf_counter()
    apply_token_bitmask(on_gpu, bitmask.pin_memory() if pinned else bitmask, rows)
    host_s = time.perf_counter() - t
    torch.cuda.synchronize()
    assert host_s < 0.05, f"the host waited {host_s:.3f} s for the GPU"
    assert torch.equal(on_gpu.cpu().double(), want)
