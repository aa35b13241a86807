"""Decode steps on static, padded buffers, captured as CUDA graphs on GPU. Each row is one query: a
decoding sequence, or one token of a short prefill chunk (worker/inputs.py says when).

A decode forward launches a few dozen kernels per layer; replayed from a CUDA graph it is one launch, so
the host stops being the bottleneck. Graphs need fixed shapes and addresses, so the batch is padded up to
a bucket size and each sequence's block table to a bucket of blocks; the inputs of a step are packed into
one pinned host buffer and copied to the device with one transfer. Padding rows write their keys/values
into a trash slot (one extra cache block nobody owns) and attend only to key 0. A row whose input token
was sampled on the device (the previous step's output) reads it from the batch's `token_feed` buffer
inside the graph, so the host never needs that value to launch the step.

Every (batch bucket, block bucket) graph is captured at start-up (`capture_all`, before the engine takes
requests), largest first, into one memory pool: the graphs run one at a time, so they share the pool's
memory, and each copies its logits into one buffer they all share. The same padded path can run without
capture ("padded" mode), which is how CPU tests check its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from tp_runtime.layers.attention import AttentionBackend, AttentionMetadata
from tp_runtime.worker.inputs import GraphDecodeBatch, fed_input_ids

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as GraphPool  # what torch.cuda.graph_pool_handle() returns

# Columns of the packed input buffer before the block table. _FEED: the batch row whose last sampled
# token (in token_feed) is this row's input, or -1 for a token the host knows; _ROW: the row's batch row.
_IDS, _POS, _SLOT, _LEN, _FEED, _ROW, _TABLE = 0, 1, 2, 3, 4, 5, 6


@contextmanager
def recording(
    graph: torch.cuda.CUDAGraph, pool: GraphPool | None, stream: torch.cuda.Stream
) -> Iterator[None]:
    """Record the work queued inside into `graph`, on `stream` (capture needs one other than the default),
    allocating from `pool`. Unlike torch.cuda.graph it does not synchronize or empty the allocator's cache
    first: start-up records hundreds of graphs back to back, and each would pay for both."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def block_buckets(max_blocks: int, reads_table_padding: bool) -> list[int]:
    """Block-table widths the graphs are captured for. Where attention reads a row's whole table
    (`reads_table_padding`, the gather path): powers of two up to 32 blocks, then steps of 32, at most ~1.3x
    padding of the keys gathered for a long context. Where it stops at each row's length, the width only
    sizes the table copy and the split count: powers of two."""
    if reads_table_padding:
        sizes = [b for b in (4, 8, 16) if b < max_blocks]
        sizes += range(32, max_blocks, 32)
    else:
        sizes = [1 << i for i in range(2, max(2, (max_blocks - 1).bit_length())) if 1 << i < max_blocks]
    return [*sizes, max_blocks]


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        block_size: int,
        max_batch: int,
        max_blocks: int,
        trash_slot: int,
        device: torch.device,
        capture: bool,
        token_feed: torch.Tensor,
        attention: AttentionBackend,
        pool: GraphPool | None = None,
        graph_pass: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        """`forward(input_ids, positions, meta)` returns the logits of every row. `pool`: the graph memory
        pool to record into (None: one of its own). `graph_pass()` is entered around each graph's warm-up
        and capture (layers/linear.py decode_graph_pass)."""
        self._forward = forward
        self._graph_pass = graph_pass
        self.block_size = block_size
        self.batch_sizes = batch_buckets(max_batch)
        self.block_sizes = block_buckets(max_blocks, attention.reads_table_padding)
        self.trash_slot = trash_slot
        self.device = device
        self.capture = capture
        self.attention = attention
        width = _TABLE + max_blocks
        rows = self.batch_sizes[-1]
        self._staging = torch.zeros((rows, width), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staging_np = self._staging.numpy()
        self._inputs = torch.zeros((rows, width), dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [rows, vocab], written by every graph (made at the first)
        self._stream: torch.cuda.Stream | None = None  # warm-up and capture run on it
        if pool is None and capture:
            pool = torch.cuda.graph_pool_handle()
        self._pool = pool
        self._token_feed = token_feed
        # Recorded after each staging->device copy: the host must not refill the pinned buffer before the
        # copy ran, and with steps queued ahead of the device nothing else guarantees that.
        self._staging_free = torch.cuda.Event() if device.type == "cuda" else None

    def supports(self, num_rows: int) -> bool:
        return num_rows <= self.batch_sizes[-1]

    def padded_shape(self, num_rows: int, max_seq_len: int) -> tuple[int, int]:
        """The (rows, blocks) graph that runs a step of `num_rows` rows whose longest context is
        `max_seq_len` tokens."""
        blocks = -(-max_seq_len // self.block_size)
        return self._bucket(self.batch_sizes, num_rows), self._bucket(self.block_sizes, blocks)

    @staticmethod
    def _bucket(sizes: list[int], n: int) -> int:
        return next(s for s in sizes if s >= n)

    def _run_forward(self, rows: int, blocks: int) -> torch.Tensor:
        inputs = self._inputs[:rows]
        input_ids = fed_input_ids(inputs[:, _IDS], inputs[:, _FEED], self._token_feed)
        meta = AttentionMetadata(
            backend=self.attention,
            slot_mapping=inputs[:, _SLOT].contiguous(),  # the fused rotary+cache kernel wants it dense
            num_decode_tokens=rows,
            decode_block_tables=inputs[:, _TABLE : _TABLE + blocks],
            decode_seq_lens=inputs[:, _LEN],
            decode_num_splits=self.attention.num_decode_splits(rows, blocks),
        )
        return self._forward(input_ids, inputs[:, _POS], meta)

    def graph_width(self, rows: int, blocks: int) -> int:
        """The block-table width of the graph that runs a (rows, blocks) step. Where attention reads only
        each row's length, two widths with the same split count launch the same kernels (the table's row
        stride is the buffer's either way), so they share the widest one's graph: a few graphs per batch
        bucket instead of one per block bucket."""
        if self.attention.reads_table_padding:
            return blocks
        splits = self.attention.num_decode_splits(rows, blocks)
        wider = [b for b in self.block_sizes if b >= blocks]
        return max(b for b in wider if self.attention.num_decode_splits(rows, b) == splits)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, width) graph, largest first."""
        shapes = {(r, self.graph_width(r, b)) for r in self.batch_sizes for b in self.block_sizes}
        return sorted(shapes, reverse=True)

    def _reset_inputs(self) -> None:
        """Every row a padding row (what start-up captures the graphs on)."""
        inputs = self._inputs
        inputs.zero_()
        inputs[:, _SLOT] = self.trash_slot
        inputs[:, _LEN] = 1
        inputs[:, _FEED] = -1

    def run_warm_ups(self) -> None:
        """Each graph's warm-up forward, eagerly and without capturing (the kernel precompiler's dry pass
        runs these to find the Triton kernels the graphs launch)."""
        if not self.capture:
            return
        self._reset_inputs()
        with self._graph_pass():
            stream, current = self._side_stream(), torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for rows, blocks in self.shapes():
                    self._run_forward(rows, blocks)
            current.wait_stream(stream)

    def capture_all(self, progress: Callable[[], None] = lambda: None) -> None:
        """Capture every graph now (`progress()` after each), on inputs that are all padding rows."""
        if not self.capture:
            return
        self._reset_inputs()
        for rows, blocks in self.shapes():
            if (rows, blocks) not in self._graphs:
                self._graphs[(rows, blocks)] = self._capture(rows, blocks)
            progress()

    def _capture(self, rows: int, blocks: int) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (lazy inits, the allocator, Triton compiling and loading the kernels the
        # graph uses), then record.
        with self._graph_pass():
            stream, current = self._side_stream(), torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                warm = self._run_forward(rows, blocks)
            if self._logits is None:  # outside the pool: the graphs' shared output
                self._logits = torch.empty(
                    (self.batch_sizes[-1], warm.shape[1]), dtype=warm.dtype, device=self.device
                )
            del warm
            graph = torch.cuda.CUDAGraph()
            with recording(graph, self._pool, stream):
                self._logits[:rows].copy_(self._run_forward(rows, blocks))
            current.wait_stream(stream)
        return graph

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def run(self, step: GraphDecodeBatch) -> torch.Tensor:
        """Logits [num_rows, vocab] of one step."""
        n = len(step.input_ids)
        rows, blocks = self.padded_shape(n, int(step.seq_lens.max()))
        blocks = self.graph_width(rows, blocks)
        used = min(blocks, step.block_tables.shape[1])
        if self._staging_free is not None:
            self._staging_free.synchronize()  # long done in steady state: it ran before the last forward
        st = self._staging_np
        st[:n, _IDS] = step.input_ids
        st[:n, _POS] = step.positions
        st[:n, _SLOT] = step.slots
        st[:n, _LEN] = step.seq_lens
        st[:n, _FEED] = step.feed
        st[:n, _ROW] = step.batch_rows
        st[:n, _TABLE : _TABLE + used] = step.block_tables[:, :used]
        st[:n, _TABLE + used : _TABLE + blocks] = 0
        st[n:rows, :] = 0
        st[n:rows, _SLOT] = self.trash_slot
        st[n:rows, _LEN] = 1
        st[n:rows, _FEED] = -1
        self._inputs[:rows].copy_(self._staging[:rows], non_blocking=True)  # one transfer
        if self._staging_free is not None:
            self._staging_free.record()
        if not self.capture:
            return self._run_forward(rows, blocks)[:n]
        key = (rows, blocks)
        graph = self._graphs.get(key)
        if graph is None:  # capture_all was not called (tests, benchmarks that time a first capture)
            graph = self._graphs[key] = self._capture(rows, blocks)
        graph.replay()
        assert self._logits is not None
        return self._logits[:n]

    def batch_rows(self, n: int) -> torch.Tensor:
        """Batch row of each of the last run's rows, on the device (where their sampled ids go)."""
        return self._inputs[:n, _ROW]
