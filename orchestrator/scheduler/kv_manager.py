"""Request- and session-level KV operations on top of the block pool.

Ownership: every reference in the pool is held by exactly one holder — a request (its
``block_table``) or a session that retains its last turn's table.  Admission takes the session's
retained table when there is one, else the longest verified prefix hit, and allocates blocks for the
rest of the prompt at once; the prompt's full blocks are sealed (findable) right away but marked
computed only when their chunk's result is back, so a concurrent request with the same prefix waits
for them instead of computing them twice.  Decode grows a table block by block, by position.
"""

from __future__ import annotations

import enum

from agentserve.orchestrator.scheduler.block_manager import ROOT_HASH, BlockManager, block_hash
from agentserve.orchestrator.scheduler.request import Request
from agentserve.orchestrator.scheduler.session_kv import SessionKV


class Admit(enum.IntEnum):
    OK = 0
    DEFER = 1  # a prefix hit is still being computed by another request: try again later
    NO_SPACE = 2


class KVManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, req: Request) -> list[int]:
        """Chained hashes (and keys) of the full blocks of ``req.tokens``, extended incrementally."""
        hashes, keys, tokens, bs = req.hashes, req.keys, req.tokens, self.block_size
        h = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), len(tokens) // bs):
            key = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(h, key)
            hashes.append(h)
            keys.append(key)
        return hashes

    def match(self, req: Request) -> tuple[list[int], bool]:
        """Blocks holding a verified prefix of ``req.tokens``, and whether all are computed.

        The walk is remembered in ``req.hit_cache`` as (block, epoch) pairs: the next call (the
        admission after the submit-time peek, or a retry) only re-checks the epochs — a block
        whose epoch is unchanged still holds the same content — and walks on from there.
        """
        blocks, table, keys = self.pool.blocks, self.pool.table, req.keys
        hashes = self._hashes(req)
        cache = req.hit_cache
        hits: list[int] = []
        ready = True
        want = None  # (parent block, its epoch): what the next hit's ``parent`` must be
        for pair in cache:
            block = blocks[pair[0]]
            if block.epoch != pair[1] or block.tokens is None:
                del cache[len(hits) :]
                break
            hits.append(pair[0])
            if ready and not block.ready:
                ready = False
                req.deferred_on = pair
            want = pair
        for i in range(len(hits), len(hashes)):  # BlockManager.lookup, inlined: this loop is hot
            bid = table.get(hashes[i])
            if bid is None:
                break
            block = blocks[bid]
            if block.parent != want or block.tokens != keys[i]:
                break
            want = (bid, block.epoch)
            hits.append(bid)
            cache.append(want)
            if ready and not block.ready:
                ready = False
                req.deferred_on = want
        if hits and len(hits) * self.block_size >= len(req.tokens):
            hits.pop()  # at least one token must be fed to sample from
        return hits, ready

    def still_deferred(self, req: Request) -> bool:
        """The block ``req`` last waited for is still being computed (checked in O(1))."""
        if req.deferred_on is None:
            return False
        block = self.pool.blocks[req.deferred_on[0]]
        if block.epoch == req.deferred_on[1] and not block.ready:
            return True
        req.deferred_on = None
        return False

    def peek_cached(self, req: Request) -> int:
        """Tokens of ``req`` that admission would find cached now (for classification)."""
        session = req.session
        if session.holds_blocks:
            return session.num_computed
        return len(self.match(req)[0]) * self.block_size

    def admit(self, req: Request) -> Admit:
        """Give ``req`` a block table for its whole prompt (retained, hit, then new blocks)."""
        session = req.session
        if session.holds_blocks:
            table, computed, sealed = session.block_table, session.num_computed, session.num_sealed
        elif self.still_deferred(req):
            return Admit.DEFER
        else:
            hits, ready = self.match(req)
            if not ready:
                return Admit.DEFER
            table, computed, sealed = hits, len(hits) * self.block_size, len(hits)
            for bid in hits:
                self.pool.acquire(bid)
        new = self.pool.allocate(max(0, self.blocks_for(len(req.tokens)) - len(table)))
        if new is None:
            if not session.holds_blocks:
                self.pool.release(table)
            return Admit.NO_SPACE
        if session.holds_blocks:
            session.block_table = []
        req.block_table = table + new
        req.num_computed, req.num_sealed, req.num_ready = computed, sealed, sealed
        req.num_cached = computed
        self.prompt_tokens += len(req.tokens)
        self.hit_tokens += computed
        self._seal_until(req, len(req.tokens) // self.block_size, ready=False)
        return Admit.OK

    def grow(self, req: Request, num_positions: int) -> bool:
        """Make ``req``'s table cover positions ``[0, num_positions)``."""
        need = self.blocks_for(num_positions) - len(req.block_table)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        req.block_table.extend(new)
        return True

    def on_computed(self, req: Request) -> None:
        """KV now exists for ``req.tokens[:req.num_computed]``: seal and mark the full blocks."""
        full = req.num_computed // self.block_size
        self._seal_until(req, full, ready=True)
        for i in range(req.num_ready, full):
            self.pool.mark_ready(req.block_table[i])
        req.num_ready = max(req.num_ready, full)

    def _seal_until(self, req: Request, num_full: int, ready: bool) -> None:
        if num_full <= req.num_sealed:
            return
        hashes = self._hashes(req)
        table, keys, seal = req.block_table, req.keys, self.pool.seal
        for i in range(req.num_sealed, num_full):
            seal(table[i], table[i - 1] if i else None, keys[i], ready, hashes[i])
        req.num_sealed = num_full

    def free(self, req: Request) -> None:
        """Drop ``req``'s references (preemption, abort); its computed full blocks stay cached."""
        self.pool.release(req.block_table)
        req.block_table = []
        req.num_computed = req.num_sealed = req.num_ready = req.blocks_sent = 0

    def retain(self, req: Request, session: SessionKV) -> None:
        """Hand a finished turn's table to its session (the session now holds the references)."""
        self.release_session(session)
        session.block_table, req.block_table = req.block_table, []
        session.num_computed, session.num_sealed = req.num_computed, req.num_ready

    def release_session(self, session: SessionKV) -> None:
        if session.block_table:
            self.pool.release(session.block_table)
        session.block_table = []
        session.num_computed = session.num_sealed = 0
        session.pin_deadline = None
