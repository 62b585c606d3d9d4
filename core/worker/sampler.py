"""Batched token sampling, vLLM semantics: penalties, greedy, temperature, top-k, top-p, min-p, seeded rows,
logprobs of the raw model distribution."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from turnout.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float] | None  # chosen token under log_softmax(raw logits); None if no row asked
    top_logprobs: list[list[tuple[int, float]]] | None  # per row top-N (token, logprob); [] if not asked


@dataclass
class SampledTensors:
    """The sampler's results, still where they were computed; `host` makes a SamplerOutput of them."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, the chosen token's; None if no row asked
    top_rows: list[int]  # the rows that asked for top logprobs, and how many each
    top_ks: list[int]
    top_logprobs: torch.Tensor | None  # [len(top_rows), max(top_ks)] float32, best first
    top_ids: torch.Tensor | None  # [len(top_rows), max(top_ks)] int64

    def to_cpu(self) -> SampledTensors:
        """A copy queued on the device's stream, into pinned memory; valid once the stream reaches it."""
        move = lambda t: None if t is None else t.to("cpu", non_blocking=True)
        return replace(self, token_ids=move(self.token_ids), logprobs=move(self.logprobs),
                       top_logprobs=move(self.top_logprobs), top_ids=move(self.top_ids))  # fmt: skip

    def host(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return SamplerOutput(token_ids, None, None)
        top: list[list[tuple[int, float]]] = [[] for _ in token_ids]
        if self.top_rows:
            vals, ids = self.top_logprobs.tolist(), self.top_ids.tolist()
            for j, (i, k) in enumerate(zip(self.top_rows, self.top_ks)):
                top[i] = list(zip(ids[j][:k], vals[j][:k], strict=True))
        return SamplerOutput(token_ids, self.logprobs.tolist(), top)


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
    logits: torch.Tensor,  # [n, V] float32, penalised; not modified
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


class Sampler:
    def __call__(self, logits, params, generators, prompt_token_ids, output_token_ids) -> SamplerOutput:
        """forward, then its results as Python lists (a host sync)."""
        return self.forward(logits, params, generators, prompt_token_ids, output_token_ids).host()

    def forward(
        self,
        logits: torch.Tensor,  # [B, V] any float dtype
        params: list[SamplingParams],  # per row
        generators: list[torch.Generator | None],  # per row; seeded rows draw only from theirs
        prompt_token_ids: list[list[int]],  # per row, for the repetition penalty
        output_token_ids: list[list[int]],  # per row, generated so far
    ) -> SampledTensors:
        """Everything on the logits' device, with no host sync."""
        B, V = logits.shape
        dev = logits.device
        raw = logits.float()  # [B, V]; never written to (may alias the caller's tensor)
        logits = raw
        pen = [i for i, p in enumerate(params) if p.needs_penalties]
        if len(pen) == B:
            logits = apply_penalties(raw, params, prompt_token_ids, output_token_ids)
        elif pen:
            idx = _index(pen, dev)
            logits = raw.clone()
            sub = (
                [params[i] for i in pen],
                [prompt_token_ids[i] for i in pen],
                [output_token_ids[i] for i in pen],
            )
            logits[idx] = apply_penalties(raw[idx], *sub)

        samp = [i for i, p in enumerate(params) if not p.greedy]
        if not samp:
            tokens = logits.argmax(-1)
        elif len(samp) == B:
            tokens = sample(logits, params, generators)
        else:
            tokens = logits.argmax(-1)
            idx = _index(samp, dev)
            tokens[idx] = sample(logits[idx], [params[i] for i in samp], [generators[i] for i in samp])

        if all(p.logprobs is None for p in params):
            return SampledTensors(tokens, None, [], [], None, None)
        lse = raw.logsumexp(-1)  # [B]
        chosen = raw.gather(1, tokens[:, None])[:, 0] - lse
        want = [i for i, p in enumerate(params) if p.logprobs]
        if not want:
            return SampledTensors(tokens, chosen, [], [], None, None)
        ks = [params[i].logprobs for i in want]
        idx = _index(want, dev)
        vals, ids = raw[idx].topk(min(max(ks), V), dim=-1)  # [len(want), nmax]
        return SampledTensors(tokens, chosen, want, ks, vals - lse[idx, None], ids)
