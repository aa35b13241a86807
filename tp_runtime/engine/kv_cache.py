"""Driver-side KV-cache accounting: a free list of fixed-size blocks and each request's block list."""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"internal: asked for {n} KV blocks with {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.blocks: dict[int, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, req_id: int, num_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold `num_tokens`; returns the new block ids, or None (nothing
        allocated) when too few blocks are free."""
        held = self.blocks.setdefault(req_id, [])
        needed = self.blocks_for(num_tokens) - len(held)
        if needed <= 0:
            return []
        if needed > self.allocator.num_free:
            return None
        new = self.allocator.allocate(needed)
        held.extend(new)
        return new

    def free(self, req_id: int) -> None:
        self.allocator.free(self.blocks.pop(req_id, []))

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free
