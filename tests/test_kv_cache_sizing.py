"""The CPU KV cache's size: what the configuration can use, capped by a share of the available RAM."""

from __future__ import annotations

import pytest

from tp_runtime.worker.kv_sizing import CPU_KV_CACHE_RAM_SHARE, available_memory_bytes, cpu_kv_cache_blocks

GIB = 1 << 30
MIB = 1 << 20


def test_small_configurations_get_what_they_can_use() -> None:
    # 4 sequences of 8 blocks: 32 blocks, far below 10 % of 16 GiB.
    assert cpu_kv_cache_blocks(1 * MIB, 4, 8, 16 * GIB, 0.1, 1) == 32


def test_ram_share_caps_the_cache_and_ranks_split_it() -> None:
    # SmolLM2-135M in float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes x 16 tokens = 720 KiB per block;
    # 256 sequences of 8192 tokens would need 90 GiB.
    per_block = 30 * 2 * 3 * 64 * 4 * 16
    usable = 256 * 512
    one_rank = cpu_kv_cache_blocks(per_block, 256, 512, 16 * GIB, 0.1, 1)
    assert one_rank == int(16 * GIB * 0.1) // per_block < usable
    three_ranks = cpu_kv_cache_blocks(per_block, 256, 512, 16 * GIB, 0.1, 3)
    assert three_ranks == int(16 * GIB * 0.1 / 3) // per_block
    assert 3 * three_ranks * per_block <= 16 * GIB * 0.1  # the ranks of a host share the budget
    # A fixed size (cpu_kv_cache_gib=1): the whole GiB for this rank, still no more than usable.
    assert cpu_kv_cache_blocks(per_block, 256, 512, GIB, 1.0, 1) == GIB // per_block
    assert cpu_kv_cache_blocks(per_block, 1, 512, GIB, 1.0, 1) == 512


def test_at_least_one_block_even_without_memory() -> None:
    assert cpu_kv_cache_blocks(1 * MIB, 4, 8, 0, 0.1, 2) == 1
    assert cpu_kv_cache_blocks(1 * MIB, 4, 8, -5, 0.1, 2) == 1


@pytest.mark.parametrize(
    "args", [(0, 1, 1, GIB, 0.1, 1), (1, 0, 1, GIB, 0.1, 1), (1, 1, 0, GIB, 0.1, 1), (1, 1, 1, GIB, 0.0, 1),
             (1, 1, 1, GIB, 1.5, 1), (1, 1, 1, GIB, 0.1, 0)],
)  # fmt: skip
def test_bad_inputs_are_internal_errors(args: tuple[int, int, int, int, float, int]) -> None:
    with pytest.raises(ValueError, match="internal"):
        cpu_kv_cache_blocks(*args)


def test_available_memory_is_plausible() -> None:
    available = available_memory_bytes()
    assert 64 * MIB < available < 1 << 50
    assert 0.0 < CPU_KV_CACHE_RAM_SHARE <= 0.5
