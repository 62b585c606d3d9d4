"""Batched token sampling, vLLM semantics. Per step, in vLLM's order: bad words, min_tokens and logit_bias,
then penalties, then greedy or temperature / top-k / top-p / min-p with seeded rows; logprobs come from
the raw model distribution. `Sampler.forward` leaves its results on the device with no host sync (async
scheduling reads them a step later); calling the Sampler also brings them to the host."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from turnout.sampling_params import SamplingParams
from turnout.worker import sample_kernel

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # chosen token under log_softmax(raw logits); None if no row asked
    ranks: list[int] | None  # chosen token's rank there: 1 + how many tokens have a higher logprob
    top_logprobs: list[TopLogprobs] | None  # per row top-N; [] where not asked


@dataclass
class SampledTensors:
    """The sampler's results, still where they were computed; `host` makes a SamplerOutput of them."""

    token_ids: torch.Tensor  # [B] int64
    want: list[int]  # the rows that asked for logprobs
    num_top: list[int]  # how many top logprobs each of them asked
    logprobs: torch.Tensor | None = None  # [len(want)] float32: the chosen token's
    ranks: torch.Tensor | None = None  # [len(want)] int64
    top_logprobs: torch.Tensor | None = None  # [len(want), max(num_top)] float32, best first
    top_ids: torch.Tensor | None = None  # [len(want), max(num_top)] int64

    def to_cpu(self) -> SampledTensors:
        """A copy queued on the device's stream, into pinned memory; valid once the stream reaches it."""
        names = ("token_ids", "logprobs", "ranks", "top_logprobs", "top_ids")
        move = lambda t: None if t is None else t.to("cpu", non_blocking=True)
        return replace(self, **{n: move(getattr(self, n)) for n in names})

    def host(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        if not self.want:
            return SamplerOutput(token_ids, None, None, None)
        n = len(token_ids)
        out = SamplerOutput(token_ids, [0.0] * n, [0] * n, [[] for _ in range(n)])
        lps, ranks, tops = _lists(self.logprobs, self.ranks, self.top_logprobs, self.top_ids, self.num_top)
        for j, i in enumerate(self.want):
            out.logprobs[i], out.ranks[i], out.top_logprobs[i] = lps[j], ranks[j], tops[j]  # type: ignore[index]
        return out


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without a host sync: a pinned copy queued in stream order."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _flat(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index and token id of every token in `rows`: two [N] int64 tensors."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    toks = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lens.sum()))
    row_ids = np.repeat(np.arange(len(rows), dtype=np.int64), lens)
    return upload(row_ids, device), upload(toks, device)


def _cols(rows: list[tuple[float, ...]], device: torch.device) -> torch.Tensor:
    """Per-row parameters as a [fields, n] float32 tensor (numpy: torch.tensor on lists is ~3x slower)."""
    return upload(np.array(rows, dtype=np.float32).reshape(len(rows), -1).T.copy(), device)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return upload(np.array(rows, dtype=np.int64), device)


def banned_tokens(p: SamplingParams, output_token_ids: list[int], num_out: int) -> list[int]:
    """Tokens this row may not draw now: a bad word's last token once the output ends with the rest of it
    (a one-token word always), and EOS / stop tokens while fewer than min_tokens (num_out) are out."""
    n = len(output_token_ids)
    banned = [
        w[-1]
        for w in p.bad_words_token_ids
        if n >= len(w) - 1 and output_token_ids[n - len(w) + 1 :] == w[:-1]
    ]
    if num_out < p.min_tokens:
        banned += p.stop_token_ids + ([] if p.ignore_eos else p.eos_token_ids)
    return banned


def apply_logits_processors(
    logits: torch.Tensor,  # [n, V] float32; written in place
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    num_output_tokens: list[int],
) -> None:
    dev = logits.device
    banned = [banned_tokens(*row) for row in zip(params, output_token_ids, num_output_tokens, strict=True)]
    if any(banned):
        rows, toks = _flat(banned, dev)
        logits[rows, toks] = -float("inf")
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if biased:
        rows, toks, bias = zip(*biased)
        bias_t = upload(np.array(bias, dtype=np.float32), dev)
        logits.index_put_((_index(list(rows), dev), _index(list(toks), dev)), bias_t, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,  # [n, V] float32
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:  # [n, V], new tensor
    n, V = logits.shape
    dev = logits.device
    pen = _cols([(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in params], dev)
    rep, presence, frequency = pen[:, :, None]  # each [n, 1]
    rows, toks = _flat(output_token_ids, dev)
    counts = torch.zeros(n, V, device=dev).index_put_(
        (rows, toks), torch.ones((), device=dev), accumulate=True
    )
    in_output = counts > 0  # [n, V]
    if any(p.repetition_penalty != 1 for p in params):
        rows, toks = _flat(
            [
                ids if p.repetition_penalty != 1 else []
                for p, ids in zip(params, prompt_token_ids, strict=True)
            ],
            dev,
        )
        seen = in_output.index_put((rows, toks), torch.ones((), dtype=torch.bool, device=dev))
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - presence * in_output - frequency * counts


def sample(
    logits: torch.Tensor,  # [n, V] float32, processed; not modified
    params: list[SamplingParams],  # all non-greedy
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [n] int64
    n, V = logits.shape
    dev = logits.device
    cols = _cols([(p.temperature, p.top_k if 0 < p.top_k < V else V, p.top_p, p.min_p) for p in params], dev)
    temp, top_k, top_p, min_p = cols[:, :, None]  # each [n, 1]
    use_k = any(0 < p.top_k < V for p in params)
    use_p = any(p.top_p < 1 for p in params)
    x = logits / temp  # [n, V]
    if use_p:
        ls, order = x.sort(dim=-1, descending=True)  # [n, V]
        if use_k:
            ls.masked_fill_(ls < ls.gather(1, top_k.long() - 1), -float("inf"))
        probs = ls.softmax(-1)
        # keep a token iff the mass strictly before it is < top_p: the smallest prefix with mass >= top_p
        drop = probs.cumsum(-1).sub_(probs) >= top_p.masked_fill(top_p >= 1, 2.0)
        x.scatter_(1, order, ls.masked_fill_(drop, -float("inf")))
    elif use_k:
        kmax = max(p.top_k for p in params if 0 < p.top_k < V)
        thr = x.topk(kmax, dim=-1).values.gather(1, top_k.clamp(max=kmax).long() - 1)  # [n, 1]
        x.masked_fill_(x < thr.masked_fill_(top_k > kmax, -float("inf")), -float("inf"))
    if any(p.min_p > 0 for p in params):
        # p < min_p * p_max  <=>  x < x_max + log(min_p); min_p = 0 gives -inf, keeping all
        x.masked_fill_(x < x.amax(-1, keepdim=True) + min_p.log(), -float("inf"))
    probs = x.softmax(-1)
    # exponential race: argmax(probs / q), q ~ Exp(1) iid, draws token i with probability probs[i]
    q = torch.empty_like(probs)
    if any(g is None for g in generators):
        q.exponential_()
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device == q.device:
            q[i].exponential_(generator=g)
        else:
            q[i] = torch.empty(V, device=g.device).exponential_(generator=g).to(dev)
    return probs.div_(q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(-1)


def logprob_tensors(
    raw: torch.Tensor,  # [B, V] float32 raw logits
    token_ids: torch.Tensor,  # [B] int64
    k: int,  # how many top logprobs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprob [B] and rank [B] of each row's token under log_softmax(raw), and the top k of every row
    ([B, k] logprobs and token ids; None for k = 0), on raw's device with no host sync."""
    lp = raw.log_softmax(-1)  # [B, V]
    chosen = lp.gather(1, token_ids[:, None])  # [B, 1]
    ranks = (lp >= chosen).sum(-1)  # ties count for the token, as in vLLM
    if (k := min(k, raw.shape[1])) <= 0:
        return chosen[:, 0], ranks, None, None
    vals, ids = lp.topk(k, dim=-1)
    return chosen[:, 0], ranks, vals, ids


def _lists(
    chosen: torch.Tensor,
    ranks: torch.Tensor,
    vals: torch.Tensor | None,
    ids: torch.Tensor | None,
    num_top: list[int],
) -> tuple[list[float], list[int], list[TopLogprobs]]:
    top: list[TopLogprobs] = [[] for _ in num_top]
    if vals is not None and ids is not None:
        for i, (v, t) in enumerate(zip(vals.tolist(), ids.tolist())):
            top[i] = list(zip(t[: num_top[i]], v[: num_top[i]]))
    return chosen.tolist(), ranks.tolist(), top


def gather_logprobs(
    raw: torch.Tensor,  # [B, V] float32 raw logits
    token_ids: torch.Tensor,  # [B] int64
    num_top: list[int],  # per row, how many top logprobs
) -> tuple[list[float], list[int], list[TopLogprobs]]:
    """Logprob and rank of each row's token under log_softmax(raw), and each row's top num_top."""
    return _lists(*logprob_tensors(raw, token_ids, max(num_top)), num_top)


class Sampler:
    def __call__(
        self, logits, params, generators, prompt_token_ids, output_token_ids, num_output_tokens=None
    ) -> SamplerOutput:
        """forward, then its results as Python lists (a host sync)."""
        return self.forward(
            logits, params, generators, prompt_token_ids, output_token_ids, num_output_tokens
        ).host()

    def forward(
        self,
        logits: torch.Tensor,  # [B, V] any float dtype
        params: list[SamplingParams],  # per row
        generators: list[torch.Generator | None],  # per row; seeded rows draw only from theirs
        prompt_token_ids: list[list[int]],  # per row; filled where params.needs_history
        output_token_ids: list[list[int]],  # per row, generated so far; filled where needs_history
        num_output_tokens: list[int] | None = None,  # per row, outputs before this one; None = their lens
    ) -> SampledTensors:
        """Everything on the logits' device, with no host sync."""
        seeded = any(g is not None for g in generators)
        if sample_kernel.can_sample(logits, params, seeded):
            temps = _cols([(0.0 if p.greedy else p.temperature,) for p in params], logits.device)[0]
            tokens = sample_kernel.gumbel_argmax(logits, temps)
        else:
            raw = logits.float()  # [B, V]; never written to (may alias the caller's tensor)
            counts = (
                num_output_tokens if num_output_tokens is not None else [len(o) for o in output_token_ids]
            )
            processed = self.process(raw, params, prompt_token_ids, output_token_ids, counts)
            tokens = self.pick(processed, params, generators)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not want:
            return SampledTensors(tokens, [], [])
        num_top = [params[i].logprobs or 0 for i in want]
        idx = _index(want, logits.device)
        lps = logprob_tensors(logits[idx].float(), tokens[idx], max(num_top))
        return SampledTensors(tokens, want, num_top, *lps)

    def process(
        self,
        raw: torch.Tensor,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        num_output_tokens: list[int],
    ) -> torch.Tensor:
        """raw, or a new tensor with bad words, min_tokens, logit_bias and penalties applied."""
        logits = raw
        if any(p.bad_words_token_ids or p.min_tokens or p.logit_bias for p in params):
            logits = raw.clone()
            apply_logits_processors(logits, params, output_token_ids, num_output_tokens)
        pen = [i for i, p in enumerate(params) if p.needs_penalties]
        if len(pen) == len(params):
            return apply_penalties(logits, params, prompt_token_ids, output_token_ids)
        if pen:
            idx = _index(pen, raw.device)
            logits = logits.clone() if logits is raw else logits
            sub = (
                [params[i] for i in pen],
                [prompt_token_ids[i] for i in pen],
                [output_token_ids[i] for i in pen],
            )
            logits[idx] = apply_penalties(logits[idx], *sub)
        return logits

    def pick(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:  # [B] int64
        samp = [i for i, p in enumerate(params) if not p.greedy]
        if len(samp) == len(params):
            return sample(logits, params, generators)
        tokens = logits.argmax(-1)
        if samp:
            idx = _index(samp, logits.device)
            tokens[idx] = sample(logits[idx], [params[i] for i in samp], [generators[i] for i in samp])
        return tokens
