"""Block pool: refcounts, chained-hash prefix hits that are never wrong, LRU eviction."""

from __future__ import annotations

import pytest

from agentserve.orchestrator.scheduler import block_manager
from agentserve.orchestrator.scheduler.block_manager import BlockManager
from agentserve.orchestrator.scheduler.kv_manager import Admit, KVManager
from agentserve.orchestrator.scheduler.request import Request
from agentserve.orchestrator.scheduler.session_kv import SessionKV
from agentserve.protocol.sampling import SamplingParams

BS = 4


def request(seq_id: int, tokens: list[int], session: SessionKV | None = None) -> Request:
    return Request(seq_id, session or SessionKV(f"s{seq_id}"), list(tokens), SamplingParams(), 0, 0.0)


def computed(kv: KVManager, req: Request) -> None:
    req.num_computed = len(req.tokens)
    kv.on_computed(req)


def test_allocate_release_refcounts():
    pool = BlockManager(4, BS)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.num_available() == 1
    assert pool.allocate(2) is None, "must not hand out more blocks than it has"
    pool.acquire(a[0])
    pool.release(a)
    assert pool.blocks[a[0]].ref == 1 and pool.num_available() == 3
    pool.release([a[0]])
    with pytest.raises(AssertionError):
        pool.release([a[0]])
    pool.check()


def test_prefix_hit_shares_full_blocks_only():
    kv = KVManager(16, BS)
    first = request(1, list(range(10, 20)))  # 2 full blocks + 2 tokens
    assert kv.admit(first) is Admit.OK
    computed(kv, first)
    second = request(2, list(range(10, 20)) + [99, 98])
    assert kv.admit(second) is Admit.OK
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2], "a partial block is never shared"
    assert second.num_computed == 8
    assert kv.pool.blocks[first.block_table[0]].ref == 2


def test_hit_is_verified_even_when_every_hash_collides(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens: 7)
    import agentserve.orchestrator.scheduler.kv_manager as kvm

    monkeypatch.setattr(kvm, "block_hash", lambda parent, tokens: 7)
    kv = KVManager(16, BS)
    a = request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.admit(a) is Admit.OK
    computed(kv, a)
    b = request(2, [1, 2, 3, 4, 50, 60, 70, 80, 9])  # same first block, different second
    assert kv.admit(b) is Admit.OK
    assert b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1], "a colliding hash must not produce a wrong hit"
    assert b.num_computed == 4
    c = request(3, [9, 9, 9, 9, 5, 6, 7, 8, 9])  # differs in the parent block
    assert kv.admit(c) is Admit.OK and c.num_computed == 0


def test_child_hit_needs_the_same_parent_block():
    kv = KVManager(8, BS)
    a = request(1, list(range(1, 10)))
    assert kv.admit(a) is Admit.OK
    computed(kv, a)
    parent, child = a.block_table[:2]
    kv.free(a)
    kv.pool.cached.move_to_end(child)  # make the parent the LRU head
    filler = kv.pool.allocate(len(kv.pool.free) + 1)  # drains free, evicts the parent
    assert filler is not None
    assert kv.pool.blocks[parent].tokens is None and kv.pool.blocks[child].tokens is not None
    kv.pool.release(filler)
    b = request(2, [1, 2, 3, 4, 100])  # recreates the parent's content in another block
    assert kv.admit(b) is Admit.OK
    computed(kv, b)
    hits, _ = kv.match(request(3, list(range(1, 10))))
    assert hits == [b.block_table[0]], "the old child hangs off an evicted parent: no hit"


def test_lru_evicts_oldest_cached_first():
    kv = KVManager(4, BS)
    old, new = request(1, [1, 2, 3, 4, 0]), request(2, [5, 6, 7, 8, 0])
    for r in (old, new):
        assert kv.admit(r) is Admit.OK
        computed(kv, r)
    old_block, new_block = old.block_table[0], new.block_table[0]
    kv.free(old)
    kv.free(new)
    assert kv.pool.allocate(3) is not None  # 2 free + evicts one cached
    assert kv.pool.blocks[old_block].tokens is None, "the least recently released block goes first"
    assert kv.pool.blocks[new_block].tokens == (5, 6, 7, 8)


def test_unready_hit_defers_then_shares():
    kv = KVManager(16, BS)
    owner = request(1, list(range(1, 13)))
    assert kv.admit(owner) is Admit.OK  # prompt blocks sealed but not computed yet
    follower = request(2, list(range(1, 13)) + [77])
    assert kv.admit(follower) is Admit.DEFER
    computed(kv, owner)
    assert kv.admit(follower) is Admit.OK
    assert follower.block_table[:3] == owner.block_table[:3]


def test_freed_unready_blocks_are_not_findable():
    kv = KVManager(16, BS)
    owner = request(1, list(range(1, 13)))
    assert kv.admit(owner) is Admit.OK
    kv.free(owner)  # preempted before computing anything
    follower = request(2, list(range(1, 13)))
    assert kv.admit(follower) is Admit.OK and follower.num_computed == 0
    kv.pool.check()


def test_retained_session_table_is_taken_over():
    kv = KVManager(16, BS)
    session = SessionKV("s")
    turn = request(1, [5, 6, 7, 8, 9, 10], session)
    assert kv.admit(turn) is Admit.OK
    turn.num_computed = 6
    kv.on_computed(turn)
    kv.retain(turn, session)
    assert session.block_table and not turn.block_table
    nxt = request(2, [5, 6, 7, 8, 9, 10, 11, 12, 13], session)
    assert kv.admit(nxt) is Admit.OK
    assert nxt.num_computed == 6, "the partial block of the retained turn is reused too"
    assert not session.block_table
