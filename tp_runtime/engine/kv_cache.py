"""Driver-side KV-cache accounting: a pool of fixed-size blocks, each request's block list, and automatic
prefix caching.

With prefix caching every full block a request has computed is registered under a hash of its parent
block's hash and its own token ids (sha256 chained from the first block, so a hash names the whole prefix
up to its block and a collision would need one in sha256). A new request (or a preempted one resuming)
takes the longest run of registered blocks its tokens hash to, and computes from there. Blocks are
reference-counted; a block no request holds goes to the tail of an LRU free queue and stays registered,
reusable, until the head of the queue is taken for new blocks. A request's blocks are freed tail first, so
a shared head stays longest.

A block's KV depends only on the tokens up to its end (and the model), never on a layer's sliding window
or soft-cap, so every family shares blocks. Workers see block ids only: a hit is a request whose first
`num_computed_tokens` are already in its blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# The hash before a request's first block (its parent): one engine's blocks share one model, so nothing
# else goes in.
_ROOT = b"tp_runtime prefix cache v1"


def salted_root(salt: str) -> bytes:
    """The hash before the first block of a request with a cache salt (vLLM's cache_salt): its blocks are
    found only by requests with the same salt, so tenants that do not share one cannot learn from the
    cache's timing what others sent."""
    return hashlib.sha256(_ROOT + b"\0salt\0" + salt.encode("utf-8")).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash that names a full block: its parent's hash (the whole prefix before it) and its token ids."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockPool:
    """Blocks with reference counts; the free ones in an LRU queue (least recently freed first), where a
    registered block stays findable by its hash until it is taken for new content."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> the block registered under it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks for new content, from the head of the free queue (their old registration dropped)."""
        if n > len(self._free):
            raise RuntimeError(f"internal: asked for {n} KV blocks with {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            self.hash_of[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def touch(self, blocks: list[int]) -> None:
        """A request takes registered blocks: one more reference each (out of the free queue if free)."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        """One reference less for each block; a registered block no request holds goes to the free queue's
        tail, in the order given (the first given is evicted first), an unregistered one (a partial last
        block, which no lookup can find) to its head, to be taken before any cached block."""
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"internal: KV block {block} freed more often than taken")
            if self.ref_count[block] == 0:
                self._free[block] = None
                if self.hash_of[block] is None:
                    self._free.move_to_end(block, last=False)

    def register(self, block: int, h: bytes) -> bool:
        """Make `block` (whose content is the prefix `h` names) findable, unless another block already is;
        returns whether it did."""
        if self.hash_of[block] is None and h not in self.cached:
            self.hash_of[block] = h
            self.cached[h] = block
            return True
        return False

    def unregister(self, block: int) -> None:
        """No lookup finds `block` any more; free, it goes to the head of the free queue (taken first)."""
        self._evict(block)
        if block in self._free:
            self._free.move_to_end(block, last=False)

    def reset(self) -> None:
        """Forget every registration (the blocks and their counts stay as they are)."""
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.blocks: dict[int, list[int]] = {}
        # Per request with caching: the hashes of its full blocks of known tokens, and how many of its
        # blocks are registered.
        self._hashes: dict[int, list[bytes]] = {}
        self._registered: dict[int, int] = {}
        self._roots: dict[int, bytes] = {}  # the first block's parent hash of a request with a cache salt
        # Tokens looked up in the cache and tokens found, over the engine's life (the metrics' counters).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Blocks registered since begin_step(): the scheduler registers a step's blocks when it schedules
        # the step, before their keys and values exist, so a step that never ran must take them back.
        self._step_registered: list[int] = []

    def set_cache_salt(self, req_id: int, salt: str) -> None:
        """The request's blocks are hashed under `salt`: only requests with the same salt share them."""
        self._roots[req_id] = salted_root(salt)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, req_id: int, prompt: Sequence[int], output: Sequence[int]) -> list[bytes]:
        """The hashes of the full blocks of the request's known tokens (`prompt` then `output`), extended
        as they grow."""
        hashes = self._hashes.setdefault(req_id, [])
        bs, split = self.block_size, len(prompt)
        for i in range(len(hashes), (split + len(output)) // bs):
            start, end = i * bs, (i + 1) * bs
            tokens = (
                prompt[start:end]
                if end <= split
                else [*prompt[start:end], *output[max(0, start - split) : end - split]]
            )
            hashes.append(block_hash(hashes[-1] if hashes else self._roots.get(req_id, _ROOT), tokens))
        return hashes

    def find_cached_prefix(self, req_id: int, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        """The registered blocks that hold the longest prefix of a request about to start from nothing
        (its known tokens: `prompt` then `output`), leaving at least its last token to compute so that its
        step makes the next token's logits."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._block_hashes(req_id, prompt, output)
        usable = min(len(hashes), (len(prompt) + len(output) - 1) // self.block_size)
        hit: list[int] = []
        cached = self.pool.cached
        for h in hashes[:usable]:
            block = cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """A request started with `num_hit_tokens` of its `num_tokens` found in the cache (metrics)."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def allocate_slots(
        self, req_id: int, num_tokens: int, cached: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens`, starting a new request with the `cached` blocks
        find_cached_prefix gave; returns the blocks added (cached ones first), or None (nothing taken) when
        too few blocks are free."""
        held = self.blocks.setdefault(req_id, [])
        cached = cached or []
        needed = self.blocks_for(num_tokens) - len(held) - len(cached)
        free_hits = sum(1 for b in cached if self.pool.ref_count[b] == 0)  # leave the free queue on taking
        if needed > self.pool.num_free - free_hits:
            if not held:
                del self.blocks[req_id]
            return None
        self.pool.touch(cached)
        new = cached + self.pool.allocate(max(0, needed))
        held.extend(new)
        return new

    def cache_full_blocks(
        self, req_id: int, prompt: Sequence[int], output: Sequence[int], num_computed: int
    ) -> None:
        """Register the request's blocks whose tokens are all known (`prompt` then `output`) and computed (the
        first `num_computed` are in the cache, or are by the time a later step reads them). Cheap when no
        block filled since the last call (most decode steps)."""
        if not self.enable_prefix_caching:
            return
        done = self._registered.get(req_id, 0)
        if min(num_computed, len(prompt) + len(output)) // self.block_size <= done:
            return
        hashes = self._block_hashes(req_id, prompt, output)
        blocks = self.blocks.get(req_id, [])
        full = min(len(hashes), num_computed // self.block_size, len(blocks))
        for i in range(done, full):
            if self.pool.register(blocks[i], hashes[i]):
                self._step_registered.append(blocks[i])
        self._registered[req_id] = max(full, done)

    def begin_step(self) -> None:
        """A step is being scheduled: what it registers from now on, drop_step_registrations takes back."""
        self._step_registered.clear()

    def drop_step_registrations(self) -> None:
        """The step being scheduled failed before it was sent, or while its forward ran (an exception or
        Ctrl-C in an in-process forward, a GPU out of memory): the blocks it registered may never hold their
        keys and values, and a later prompt with the same prefix would start from garbage. None of them is
        found again; the requests' own counts stay, so they do not register them again either."""
        for block in self._step_registered:
            self.pool.unregister(block)
        self._step_registered.clear()

    def free(self, req_id: int) -> None:
        """Drop the request's blocks, tail first (a shared head stays cached longest)."""
        self.pool.free(self.blocks.pop(req_id, [])[::-1])
        self._registered.pop(req_id, None)

    def forget(self, req_id: int) -> None:
        """A finished request: its blocks freed and its hashes dropped."""
        self.free(req_id)
        self._hashes.pop(req_id, None)
        self._roots.pop(req_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's does: only while no request holds blocks (a running one
        would register its blocks again); returns whether it did."""
        if self.blocks:
            return False
        self.pool.reset()
        self._registered.clear()
        return True

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free
