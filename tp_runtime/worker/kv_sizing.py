"""How many KV blocks a worker allocates: on a GPU what its memory share leaves after the weights and the
profiled step; on a CPU what the configuration can use, capped by a share of RAM."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tp_runtime.errors import ConfigError

# The CPU KV cache of all ranks on one host together takes at most this share of the RAM available when
# it is sized (after the weights are loaded), unless `cpu_kv_cache_gib` fixes its size.
CPU_KV_CACHE_RAM_SHARE = 0.1


@dataclass(frozen=True)
class GpuMemoryPlan:
    """One GPU's memory as the KV cache is sized, in bytes: the card's `total`, the `share` of it the engine
    may take (gpu_memory_utilization), what the weights hold, the peak of the profiled largest step (weights
    included), what is kept back for decoding and the mixed-step graphs, and what PyTorch's allocator does
    not hold but the card does (`outside`: the CUDA context, NCCL's buffers, other processes)."""

    total: int
    share: float
    weights: int
    peak: int
    reserve: int
    outside: int = 0

    def blocks(self, per_block_bytes: int) -> int:
        """KV blocks that fit in what is left; negative where nothing is (see `no_room`)."""
        return int((self.total * self.share - self.peak - self.reserve - self.outside) // per_block_bytes)

    def no_room(self, rank: int) -> ConfigError:
        gib = 1 << 30
        return ConfigError(
            f"no room for a KV cache on rank {rank}: gpu_memory_utilization={self.share} gives "
            f"{self.total * self.share / gib:.2f} GiB of the GPU's {self.total / gib:.2f} GiB, and the "
            f"weights take {self.weights / gib:.2f} GiB, the largest step's activations "
            f"{(self.peak - self.weights) / gib:.2f} GiB (max_num_batched_tokens), the room kept for "
            f"decoding and the mixed-step graphs {self.reserve / gib:.2f} GiB (max_num_seqs, x max_model_len "
            "with attention_backend='torch'; max_num_batched_tokens), and outside PyTorch (the CUDA context, "
            f"NCCL, other processes) {self.outside / gib:.2f} GiB; raise gpu_memory_utilization or lower "
            "those settings"
        )


def cpu_kv_cache_blocks(
    per_block_bytes: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    available_bytes: int,
    share: float,
    tp: int,
) -> int:
    """KV blocks one CPU rank allocates: what the configuration can use, every one of `max_num_seqs`
    sequences at max_model_len (`max_blocks_per_seq` blocks), capped at `share` of `available_bytes`
    split evenly over the `tp` ranks that share this host's RAM. At least 1.

    The engine then refuses a cache too small for one sequence of max_model_len, saying so.
    """
    if per_block_bytes <= 0 or max_num_seqs < 1 or max_blocks_per_seq < 1 or tp < 1:
        raise ValueError(
            f"internal: cpu_kv_cache_blocks({per_block_bytes}, {max_num_seqs}, {max_blocks_per_seq}, tp={tp})"
        )
    if not 0.0 < share <= 1.0:
        raise ValueError(f"internal: RAM share must be in (0, 1], got {share}")
    usable = max_num_seqs * max_blocks_per_seq
    budget = int(max(available_bytes, 0) * share / tp) // per_block_bytes
    return max(1, min(usable, budget))


def available_memory_bytes() -> int:
    """RAM this process can still get: /proc/meminfo's MemAvailable (else free pages from sysconf),
    lowered to the room left under a cgroup memory limit (v2 or v1) when there is one."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = 0
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < 1 << 60:  # "max" or a huge v1 value: no limit
            available = min(available, max(int(limit_text) - usage, 0))
        break
    return available
