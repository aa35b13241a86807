"""Steps with prefill on CUDA graphs, piecewise: everything but attention is recorded per token-count bucket,
and attention runs eagerly between the pieces.

A step with a prompt chunk has a new mix of sequences and lengths nearly every time, which no one graph
can hold: attention's work depends on the mix. Everything else in the forward (embedding, projections,
rotary and the cache write, norms, MLPs, all-reduces) depends only on the number of tokens. So for each
bucket of token counts the forward is recorded as one graph per stretch between two attention calls, and a
step replays them in order, padded to its bucket, running each layer's attention eagerly in between with
the step's own metadata (varlen FlashAttention for fresh prompts, the Triton kernels for continuation
chunks and decode rows). A 32-layer step is then 33 graph launches and the few launches of each layer's
attention, instead of about 1,600: vLLM's piecewise graphs, without torch.compile.

Attention reads q, k and v from buffers the pieces copy them into and writes its output into one the next
piece reads; these live outside the graphs' pool and are shared by every layer and bucket (the pieces run
one at a time). Padding tokens write their keys and values into the trash slot, and attention never reads
them. Every bucket is recorded at start-up (`capture_all`), largest first, into one pool shared with the
decode graphs. "Padded" mode runs the same pieces without capture, attention inline, so CPU tests check
the path's inputs, padding and buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tp_runtime.layers.attention import AttentionBackend, AttentionMetadata, paged_attention
from tp_runtime.worker.cuda_graphs import recording
from tp_runtime.worker.inputs import MixedStepBatch, fed_input_ids

if TYPE_CHECKING:
    from tp_runtime.worker.cuda_graphs import GraphPool

# Columns of the packed token buffer.
_IDS, _POS, _SLOT, _FEED = 0, 1, 2, 3

# Steps of more tokens than this run eagerly: their matmuls take longer than the host's launches, which
# then overlap with them (Llama-3-8B on an H200: ~1,600 launches in ~14 ms against ~40 ms of compute for
# 2,048 tokens).
MIXED_GRAPH_MAX_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts the pieces are recorded for. A padded token costs its compute, so a step pads by at
    most 16 tokens or a quarter of its own up to 256 tokens, 32 up to 1024 and 128 above (a prompt of 50
    to 1000 tokens and a few decode rows pad by 15 tokens on average, 0.3 ms of an 8B model's first-token
    step on an H200, against 28 with steps of 64); each bucket is one more set of graphs recorded at
    start-up."""
    sizes = [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, *range(288, 1024, 32)]
    sizes += range(1024, max_tokens, 128)
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass
class _AttentionCall:
    """One layer's attention between two pieces: its cache and settings, fixed when recorded."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    window: int | None
    softcap: float | None
    kv_scales: tuple[float, float]


class _Pieces:
    """A bucket's recorded pieces and the attention call after each (one fewer than pieces)."""

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[_AttentionCall] = []


class MixedStepGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_tokens: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        trash_slot: int,
        device: torch.device,
        capture: bool,
        token_feed: torch.Tensor,
        attention: AttentionBackend,
        pool: GraphPool | None,
        graph_pass: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> None:
        """`forward(input_ids, positions, meta)` returns the hidden states after the final norm, one row per
        token; `num_heads`/`num_kv_heads` are this rank's. `pool`: the graph memory pool to record into."""
        self._forward = forward
        self._graph_pass = graph_pass
        self.token_sizes = token_buckets(max_tokens)
        self.max_tokens = self.token_sizes[-1]
        self.trash_slot = trash_slot
        self.device = device
        self.capture = capture
        self.attention = attention
        self._token_feed = token_feed
        self._pool = pool
        rows = self.max_tokens
        # (static_bytes counts the device buffers below)
        self._staging = torch.zeros((rows, 4), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staging_np = self._staging.numpy()
        self._inputs = torch.zeros((rows, 4), dtype=torch.int64, device=device)
        self._reset_inputs()

        def buffer(heads: int, width: int = head_dim) -> torch.Tensor:
            return torch.zeros((rows, heads, width), dtype=dtype, device=device)

        self._q, self._k, self._v = buffer(num_heads), buffer(num_kv_heads), buffer(num_kv_heads)
        self._attn_out = buffer(num_heads)
        self._hidden = torch.zeros((rows, hidden_size), dtype=dtype, device=device)
        self._pieces: dict[int, _Pieces] = {}
        self._stream: torch.cuda.Stream | None = None
        self._staging_free = torch.cuda.Event() if device.type == "cuda" else None

    @staticmethod
    def static_bytes(
        max_tokens: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype,
    ) -> int:  # fmt: skip
        """The device bytes of the buffers the pieces share (allocated with the graphs, outside their
        pool): inputs, q, k, v, attention output and hidden rows of the largest bucket."""
        rows = token_buckets(max_tokens)[-1]
        widths = (2 * num_heads + 2 * num_kv_heads) * head_dim + hidden_size
        return rows * (4 * 8 + widths * dtype.itemsize)

    def _reset_inputs(self) -> None:
        """Every token a padding token (what start-up records the pieces on)."""
        self._inputs.zero_()
        self._inputs[:, _SLOT] = self.trash_slot
        self._inputs[:, _FEED] = -1

    def takes(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def bucket(self, num_tokens: int) -> int:
        return next(s for s in self.token_sizes if s >= num_tokens)

    def slot_mapping(self, num_tokens: int) -> torch.Tensor:
        """The device view of the step's cache slots (valid once `run` staged the step)."""
        return self._inputs[:num_tokens, _SLOT]

    # ------------------------------------------------------------------ recording

    def _run_pieces(self, tokens: int, boundary: _Boundary) -> None:
        inputs = self._inputs[:tokens]
        meta = AttentionMetadata(
            backend=self.attention, slot_mapping=inputs[:, _SLOT].contiguous(), num_decode_tokens=0,
            piece_boundary=boundary,
        )  # fmt: skip
        input_ids = fed_input_ids(inputs[:, _IDS], inputs[:, _FEED], self._token_feed)
        self._hidden[:tokens].copy_(self._forward(input_ids, inputs[:, _POS], meta))

    def capture_all(self, progress: Callable[[], None] = lambda: None) -> None:
        """Record every bucket now, largest first (`progress()` after each)."""
        if not self.capture:
            return
        self._reset_inputs()
        for tokens in reversed(self.token_sizes):
            if tokens not in self._pieces:
                self._pieces[tokens] = self._record(tokens)
            progress()

    def run_warm_ups(self) -> None:
        """Each bucket's warm-up, eagerly and without recording (the kernel precompiler's dry pass runs
        these to find the Triton kernels the pieces launch)."""
        if not self.capture:
            return
        self._reset_inputs()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        with self._graph_pass():
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for tokens in reversed(self.token_sizes):
                    self._run_pieces(tokens, _Boundary(self, pieces=None, step=None))
            current.wait_stream(stream)

    def _record(self, tokens: int) -> _Pieces:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream, current = self._stream, torch.cuda.current_stream(self.device)
        pieces = _Pieces()
        with self._graph_pass():
            stream.wait_stream(current)
            with torch.cuda.stream(stream):  # warm-up: lazy inits, Triton compiling the pieces' kernels
                self._run_pieces(tokens, _Boundary(self, pieces=None, step=None))
            boundary = _Boundary(self, pieces=pieces, step=None)
            boundary.begin_piece()
            try:
                self._run_pieces(tokens, boundary)
            finally:
                boundary.end_piece()
            current.wait_stream(stream)
        return pieces

    # ------------------------------------------------------------------ a step

    def run(self, step: MixedStepBatch) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of one step (a view of a buffer the next step rewrites)."""
        n = len(step.input_ids)
        tokens = self.bucket(n)
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous step's copy out of it has long run
        st = self._staging_np
        st[:n, _IDS] = step.input_ids
        st[:n, _POS] = step.positions
        st[:n, _SLOT] = step.slots
        st[:n, _FEED] = step.feed
        st[n:tokens] = 0
        st[n:tokens, _SLOT] = self.trash_slot
        st[n:tokens, _FEED] = -1
        self._inputs[:tokens].copy_(self._staging[:tokens], non_blocking=True)  # one transfer
        if self._staging_free is not None:
            self._staging_free.record()
        if not self.capture:
            self._run_pieces(tokens, _Boundary(self, pieces=None, step=step))
            return self._hidden[:n]
        pieces = self._pieces.get(tokens)
        if pieces is None:  # capture_all was not called
            pieces = self._pieces[tokens] = self._record(tokens)
        for graph, call in zip(pieces.graphs, pieces.calls, strict=False):
            graph.replay()
            self._attend(call, n, step.meta)
        pieces.graphs[-1].replay()
        return self._hidden[:n]

    def _attend(self, call: _AttentionCall, n: int, meta: AttentionMetadata) -> None:
        paged_attention(
            self._q[:n], self._k[:n], self._v[:n], call.k_cache, call.v_cache, meta, call.scale,
            window=call.window, softcap=call.softcap, out=self._attn_out[:n], kv_scales=call.kv_scales,
        )  # fmt: skip


class _Boundary:
    """What a layer's attention call does while the pieces run: copy q, k and v into the shared buffers,
    then (recording) close the current graph, note the call and open the next one, or (padded mode, `step`)
    attend at once; either way hand back the buffer attention's output is in by the next piece."""

    def __init__(self, owner: MixedStepGraphs, pieces: _Pieces | None, step: MixedStepBatch | None) -> None:
        self.owner = owner
        self.pieces = pieces
        self.step = step

    def begin_piece(self) -> None:
        assert self.pieces is not None and self.owner._stream is not None
        graph = torch.cuda.CUDAGraph()
        self._recording = recording(graph, self.owner._pool, self.owner._stream)
        self._recording.__enter__()
        self.pieces.graphs.append(graph)

    def end_piece(self) -> None:
        self._recording.__exit__(None, None, None)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float, window: int | None, softcap: float | None, kv_scales: tuple[float, float],
    ) -> torch.Tensor:  # fmt: skip
        owner, tokens = self.owner, q.shape[0]
        owner._q[:tokens].copy_(q)
        owner._k[:tokens].copy_(k)
        owner._v[:tokens].copy_(v)
        call = _AttentionCall(k_cache, v_cache, scale, window, softcap, kv_scales)
        if self.pieces is not None:
            self.end_piece()
            self.pieces.calls.append(call)
            self.begin_piece()
        elif self.step is not None:
            owner._attend(call, len(self.step.input_ids), self.step.meta)
        return owner._attn_out[:tokens]
