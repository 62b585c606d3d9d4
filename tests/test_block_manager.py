"""Paged KV blocks: allocation, chained-hash prefix caching, ref counts, LRU eviction, and the scheduler's
token budget, chunking and preemption order."""

from __future__ import annotations

from turnout.engine.block_manager import BlockManager
from turnout.engine.request import Request
from turnout.engine.scheduler import Scheduler
from turnout.sampling_params import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4)


def req(i: int, tokens: list[int]) -> Request:
    return Request(str(i), tokens, SP)


def admit(bm: BlockManager, r: Request) -> int:
    cached = bm.find_cached(r)
    num_cached = len(cached[0]) if cached else 0
    assert bm.allocate(r, r.num_tokens - num_cached * bm.block_size, cached)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return num_cached


def test_prefix_hit_shares_blocks_and_refcounts():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = req(0, list(range(10))), req(1, list(range(8)) + [99, 98, 97])
    assert admit(bm, a) == 0 and len(a.block_ids[0]) == 3
    assert (
        admit(bm, b) == 2
        and b.block_ids[0][:2] == a.block_ids[0][:2]
        and b.block_ids[0][2] != a.block_ids[0][2]
    )
    assert [bm.blocks[i].ref_count for i in a.block_ids[0][:2]] == [2, 2]
    assert bm.num_free_blocks == 10 - 4


def test_chained_hash_needs_same_prefix():
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, req(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # the second block equal, the first different: no hit, since hashes chain over the prefix
    assert admit(bm, req(1, [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, req(0, list(range(8))))
    again = req(1, list(range(8)))
    assert len(bm.find_cached(again)[0]) == 1  # not 2: the last token must run to produce logits


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req(0, [1, 2, 3, 4])
    admit(bm, a)
    bm.free_request(a)
    assert bm.num_free_blocks == 4
    b = req(1, [1, 2, 3, 4, 5])
    assert admit(bm, b) == 2  # revived from the free queue
    bm.free_request(b)
    c = req(2, [7, 8, 9, 10, 11, 12, 13, 14])  # needs all 4 blocks: evicts every cached one
    assert admit(bm, c) == 0
    bm.free_request(c)
    assert len(bm.find_cached(req(3, [1, 2, 3, 4, 5]))) == 0


def test_eviction_order_is_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = req(0, [1, 2, 9]), req(1, [3, 4, 9])
    admit(bm, a)
    admit(bm, b)
    bm.free_request(a)  # a's blocks freed first -> reused first
    bm.free_request(b)
    admit(bm, req(2, [5, 6, 7]))  # takes 2 blocks: a's
    assert len(bm.find_cached(req(3, [1, 2, 9]))) == 0
    assert len(bm.find_cached(req(4, [3, 4, 9]))[0]) == 1


def test_allocate_fails_cleanly_when_full():
    bm = BlockManager(num_blocks=2, block_size=2)
    r = req(0, [1, 2, 3, 4, 5])
    assert not bm.allocate(r, 5) and r.block_ids[0] == [] and bm.num_free_blocks == 2


def test_scheduler_budget_chunks_and_mixes_decode_with_prefill():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64)
    long_req, short_req = req(0, list(range(25))), req(1, list(range(100, 103)))
    s.add(long_req)
    out = s.schedule()
    assert [(r.req_id, len(r.token_ids), r.start_pos, r.sample) for r in out.requests] == [
        ("0", 10, 0, False)
    ]
    s.update(out, {}, {"0": long_req})
    s.add(short_req)
    out = s.schedule()  # the running chunk uses the whole budget; the new request waits
    assert [(r.req_id, len(r.token_ids), r.start_pos) for r in out.requests] == [("0", 10, 10)]
    s.update(out, {}, {"0": long_req})
    out = s.schedule()  # the last 5 prompt tokens sample; the new request takes the rest of the budget
    assert [(r.req_id, len(r.token_ids), r.sample) for r in out.requests] == [("0", 5, True), ("1", 3, True)]


def test_scheduler_decode_and_prefill_share_a_step():
    bm = BlockManager(num_blocks=64, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64)
    a, b = req(0, [1, 2, 3]), req(1, list(range(10, 30)))
    reqs = {"0": a, "1": b}
    s.add(a)
    out = s.schedule()
    s.update(out, {"0": 7}, reqs)  # a is now decoding
    s.add(b)
    out = s.schedule()
    assert [(r.req_id, len(r.token_ids), r.sample) for r in out.requests] == [("0", 1, True), ("1", 7, False)]


def test_preemption_takes_newest_and_it_resumes_with_its_tokens():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=6)
    old, new = req(0, [1, 2]), req(1, [3, 4])
    reqs = {"0": old, "1": new}
    s.add(old)
    s.add(new)
    s.update(s.schedule(), {"0": 5, "1": 6}, reqs)  # both need a 3rd slot -> a block each, only 1 free
    out = s.schedule()
    assert [r.req_id for r in out.requests] == ["0"] and s.num_preemptions == 1
    assert list(s.waiting) == [new] and new.num_computed_tokens == 0 and new.output_token_ids == [6]
    s.update(out, {"0": 8}, reqs)
    s.finish(old, "abort")
    out = s.schedule()
    assert [(r.req_id, r.token_ids) for r in out.requests] == [("1", [3, 4, 6])]  # recompute prompt + output


def test_a_chunk_ending_mid_block_registers_only_full_blocks():
    """Chunked prefill whose chunk ends inside a block: that block holds uncomputed rows, so no other
    request may find it by hash yet (find_cached memoises hashes for the whole prompt first)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64)
    long_req = req(0, list(range(20)))
    s.add(long_req)
    out = s.schedule()  # 10 of 20 tokens: blocks 0 and 1 full, block 2 holds rows 8-9 of 12
    s.update(out, {}, {"0": long_req})
    assert sorted(bm.cached[0].values()) == sorted(long_req.block_ids[0][:2])
    assert len(bm.find_cached(req(1, list(range(20))))[0]) == 2
    out = s.schedule()  # the next 10: blocks 2 to 4 full
    s.update(out, {}, {"0": long_req})
    assert sorted(bm.cached[0].values()) == sorted(long_req.block_ids[0][:5])


def test_a_request_waits_a_step_for_a_prefix_this_step_computes():
    """Two requests with one 64-token prompt in one step: the second would recompute what the first
    computes now, so it waits; the next step, scheduled before the first step's tokens reach the host (async
    scheduling), finds the first's blocks cached. A request sharing only a block of a long prompt runs now."""
    bm = BlockManager(num_blocks=64, block_size=16)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512, max_model_len=256)
    a, b = req(0, list(range(64))), req(1, list(range(64)))
    c = req(2, list(range(16)) + list(range(500, 600)))  # one shared block of 116 tokens
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [(r.req_id, r.start_pos, len(r.token_ids)) for r in out.requests] == [("0", 0, 64), ("2", 0, 116)]
    assert list(s.waiting) == [b]
    out = s.schedule()  # no update() between: the first step is still in flight; a and c decode
    assert [(r.req_id, r.start_pos, len(r.token_ids)) for r in out.requests] == [
        ("0", 64, 1), ("2", 116, 1), ("1", 48, 16)
    ]  # fmt: skip
    assert b.num_cached_tokens == 48 and b.block_ids[0][:3] == a.block_ids[0][:3]
