"""KV block pool: allocation, reference counts, prefix sharing by chained block hashes, LRU.

Every block is in exactly one of three places:

- ``free``   — no content, no hash;
- ``cached`` — unreferenced but sealed and computed: reusable by a prefix hit, evicted LRU-first;
- in use     — ``ref > 0`` (held by requests and by sessions whose blocks are pinned).

A *sealed* block is full and has a key ``(parent, tokens)``.  It is findable by the hash of
``(parent hash, tokens)``; a hit is verified on the exact token ids **and** on the identity of the
parent block (id and epoch — the epoch changes whenever a block is reused), so by induction a hit
always holds exactly the prefix asked for, whatever the hash does.  A sealed block may not yet be
computed (``ready`` false: its prefill is still in flight); a hit on it tells the caller to wait.
Blocks are written only before they are sealed, so shared blocks are never written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = 0


class Block:
    __slots__ = ("id", "ref", "hash", "tokens", "parent", "epoch", "ready")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref = 0
        self.hash: int | None = None
        self.tokens: tuple[int, ...] | None = None
        self.parent: tuple[int, int] | None = None  # (block id, epoch) of the previous block
        self.epoch = 0
        self.ready = False

    def reset(self) -> None:
        self.hash = self.tokens = self.parent = None
        self.ready = False
        self.epoch += 1


def block_hash(parent_hash: int, tokens: tuple[int, ...]) -> int:
    return hash((parent_hash, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.table: dict[int, int] = {}
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_available(self) -> int:
        return len(self.free) + len(self.cached)

    def num_used(self) -> int:
        return len(self.blocks) - self.num_available()

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with ``ref == 1`` (free ones first, then LRU eviction), or None."""
        if n > self.num_available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                bid = self.free.pop()
            else:
                bid, _ = self.cached.popitem(last=False)
                self._unseal(self.blocks[bid])
                self.evictions += 1
            self.blocks[bid].ref = 1
            out.append(bid)
        return out

    def acquire(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref == 0:
            del self.cached[bid]
        block.ref += 1

    def release(self, bids: Sequence[int]) -> None:
        for bid in reversed(bids):
            block = self.blocks[bid]
            if block.ref <= 0:
                raise AssertionError(f"block {bid} released more often than acquired")
            block.ref -= 1
            if block.ref:
                continue
            if block.ready and block.tokens is not None:
                self.cached[bid] = None
            else:
                self._unseal(block)
                self.free.append(bid)

    def seal(self, bid: int, parent: int | None, tokens: tuple[int, ...], ready: bool, h: int | None = None) -> int:
        """Give a full block its key and make it findable (the first sealed copy stays the one found).

        ``h``, when given, must be ``block_hash(parent's hash, tokens)`` (a caller's cached value).
        """
        block = self.blocks[bid]
        if len(tokens) != self.block_size or block.tokens is not None:
            raise AssertionError(f"block {bid}: seal needs an unsealed block and {self.block_size} tokens")
        if parent is None:
            parent_hash, block.parent = ROOT_HASH, None
        else:
            p = self.blocks[parent]
            if p.hash is None:
                raise AssertionError(f"block {bid}: parent block {parent} is not sealed")
            parent_hash, block.parent = p.hash, (parent, p.epoch)
        block.hash = block_hash(parent_hash, tokens) if h is None else h
        block.tokens = tokens
        block.ready = ready
        holder = self.table.get(block.hash)
        if holder is None:
            self.table[block.hash] = bid
        return block.hash

    def mark_ready(self, bid: int) -> None:
        self.blocks[bid].ready = True

    def lookup(self, h: int, tokens: tuple[int, ...], parent: int | None) -> int | None:
        """The block holding exactly ``tokens`` after ``parent`` (None: at position 0), or None."""
        bid = self.table.get(h)
        if bid is None:
            return None
        block = self.blocks[bid]
        if block.tokens != tokens:
            return None
        want = None if parent is None else (parent, self.blocks[parent].epoch)
        return bid if block.parent == want else None

    def _unseal(self, block: Block) -> None:
        if block.hash is not None and self.table.get(block.hash) == block.id:
            del self.table[block.hash]
        block.reset()

    def check(self, holders: dict[int, int] | None = None) -> None:
        """Assert the pool's invariants; ``holders`` (block id → references held) must match refs."""
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        for b in self.blocks:
            assert b.ref >= 0, f"block {b.id} has a negative refcount"
            if b.id in free:
                assert b.ref == 0 and b.tokens is None, f"free block {b.id} is in use or sealed"
            elif b.id in cached:
                assert b.ref == 0 and b.ready and b.tokens is not None, f"cached block {b.id} is bad"
            else:
                assert b.ref > 0, f"block {b.id} is lost (unreferenced, neither free nor cached)"
            if holders is not None:
                assert holders.get(b.id, 0) == b.ref, f"block {b.id}: ref {b.ref} != {holders.get(b.id, 0)}"
        for h, bid in self.table.items():
            assert self.blocks[bid].hash == h, f"hash table entry for block {bid} is stale"
