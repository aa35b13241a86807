"""One worker's model runner: the step's flow.

Per step, top to bottom:
  apply the scheduler's diff to the persistent batch -> build inputs (inputs.py) -> forward (TP layers, or
  a decode graph) -> sample -> bookkeeping that needs no token values (counts) -> start the ONE
  device->host copy of the sampled ids (rank 0 only, pinned, non-blocking, with an event).
Penalties and prompt logprobs add work only to steps where a request uses them: per-row token counts
kept on the device (updated from the sampled ids there), and log-softmax over the prompt positions of
prefill chunks, sent back with the sampled ids.
`execute_model` returns a PendingOutput without waiting for the device; `PendingOutput.resolve()` waits for
the copy. Sampled ids also stay on the device (the batch's `token_feed`, one slot per row) and the next step
reads its input tokens from there, so no rank needs the values on the host to launch the next step: the
host can queue step N+1 while step N still runs (async scheduling), and ranks > 0 never wait at all.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tp_runtime.config import EngineConfig
from tp_runtime.errors import ConfigError, ProtocolError
from tp_runtime.layers import kv_fp8
from tp_runtime.layers.attention import AttentionMetadata, PrefillChunk, make_attention_backend
from tp_runtime.layers.linear import decode_graph_pass
from tp_runtime.messages import GrammarMask, SchedulerOutput
from tp_runtime.worker.cuda_graphs import DecodeGraphs, batch_buckets
from tp_runtime.worker.inputs import (
    GraphDecodeBatch,
    InputBuilder,
    MixedStepBatch,
    PromptLogprobPlan,
    StepInputs,
)
from tp_runtime.worker.kernel_precompile import KernelPrecompiler, compile_threads
from tp_runtime.worker.mixed_graphs import MIXED_GRAPH_MAX_TOKENS, MixedStepGraphs
from tp_runtime.worker.outputs import HostTransfer, PendingOutput, pack_prompt_logprobs, start_host_transfer
from tp_runtime.worker.persistent_batch import (
    PenaltyState,
    PersistentBatch,
    apply_bad_words,
    apply_token_biases,
)
from tp_runtime.worker.sampler import Sampler, SamplerOutput, SamplingBatch

if TYPE_CHECKING:  # any model class behind the interface; the runner knows no architecture
    from tp_runtime.models.interface import CausalLM


class GrammarMasks:
    """Structured outputs on the worker: a step's packed bitmask (int32 words, bit i of word j allowing token
    32 j + i) unpacked on the device into the constrained rows' allowed tokens. The words go through two
    pinned host buffers, used in turn: a copy from pageable memory would first wait for the stream, that is
    for the forward the mask is meant to overlap."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.words = -(-vocab_size // 32)
        self.vocab_size = vocab_size
        self.device = device
        self._max_rows = max_rows
        self._staging: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._turn = 0
        token = torch.arange(vocab_size, dtype=torch.int32, device=device)
        self._word, self._bit = token >> 5, token & 31  # each token's word and bit, made once

    def allowed(
        self, step_id: int, ids: list[int], bitmask: bytes, sampled_req_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the constrained requests' sampling rows, their allowed tokens [rows, vocab] bool); None when
        nothing is constrained. A bitmask that does not fit the step is a ProtocolError."""
        if not ids:
            return None
        position = {r: i for i, r in enumerate(sampled_req_ids)}
        if (
            len(bitmask) != 4 * self.words * len(ids)
            or len(set(ids)) != len(ids)
            or any(r not in position for r in ids)
        ):
            raise ProtocolError(
                f"step {step_id}: a grammar bitmask of {len(bitmask)} bytes for requests {ids[:4]} does not "
                f"fit the {len(sampled_req_ids)} requests sampling and a vocabulary of {self.vocab_size}"
            )
        packed = np.frombuffer(bitmask, dtype="<i4").reshape(len(ids), self.words)
        rows_host = torch.tensor([position[r] for r in ids], dtype=torch.int64)
        if self.device.type == "cpu":
            bits, rows = torch.from_numpy(packed.astype(np.int32)), rows_host
        else:
            if not self._staging:
                self._staging = [
                    (torch.empty((self._max_rows, self.words), dtype=torch.int32, pin_memory=True),
                     torch.empty(self._max_rows, dtype=torch.int64, pin_memory=True))
                    for _ in range(2)
                ]  # fmt: skip
            words_pinned, rows_pinned = self._staging[self._turn]
            self._turn ^= 1
            words_pinned[: len(ids)].numpy()[:] = packed
            rows_pinned[: len(ids)].copy_(rows_host)
            bits = words_pinned[: len(ids)].to(self.device, non_blocking=True)
            rows = rows_pinned[: len(ids)].to(self.device, non_blocking=True)
        allowed = ((bits[:, self._word] >> self._bit) & 1).bool()  # int32 temporaries: [rows, vocab]
        return rows, allowed


@dataclass
class _AwaitingMask:
    """A step sent with grammar_mask_follows, its forward queued, waiting for its GrammarMask to sample."""

    so: SchedulerOutput
    inputs: StepInputs
    logits: torch.Tensor
    prompt_packed: torch.Tensor | None
    rows_dev: torch.Tensor
    t0: float
    t_prep: float
    forward_start: torch.cuda.Event | float | None
    timings: dict[str, float] | None


def pick_kernels(backend: str, device: torch.device) -> str:
    """ "torch" or "triton" for a kernel choice; "auto" is Triton on CUDA when it is installed."""
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "torch"
    import importlib.util

    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


# Prompt-logprob logits are made at least this many rows at a time (and the memory profile makes as many),
# so that a small max_num_seqs does not turn a long prompt into thousands of LM-head calls.
MIN_LOGITS_ROWS = 256


def largest_prefill_chunks(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[tuple[int, int]]:
    """Token ranges of the largest prefill a step can hold: max_model_len-long prompts (the last one
    shorter) filling max_num_batched_tokens, at most max_num_seqs of them."""
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    return [(start, min(start + max_model_len, num_tokens)) for start in range(0, num_tokens, max_model_len)]


class CaptureProgress:
    """The start-up capture's progress on stderr: a counter redrawn in place on a terminal, a line at the
    start and one at the end elsewhere (logs)."""

    def __init__(self, num_mixed: int, num_decode: int, show: bool) -> None:
        self.total = num_mixed + num_decode
        # Shapes, not graphs: a mixed-step shape is one graph per layer, and one more.
        self.counts = f"{num_decode} decode, {num_mixed} mixed-step"
        self.show = show
        self.done = 0
        self.start = time.perf_counter()
        self._tty = show and sys.stderr.isatty()
        if show and not self._tty:
            print(f"tp-runtime: capturing CUDA graphs of {self.total} shapes ({self.counts})",
                  file=sys.stderr, flush=True)  # fmt: skip

    def step(self) -> None:
        self.done += 1
        if self._tty:
            print(f"\rtp-runtime: capturing CUDA graphs: shape {self.done}/{self.total}", end="",
                  file=sys.stderr, flush=True)  # fmt: skip

    def finish(self) -> None:
        if self.show:
            seconds = time.perf_counter() - self.start
            start = "\r" if self._tty else ""
            print(f"{start}tp-runtime: captured CUDA graphs of {self.total} shapes ({self.counts}) in "
                  f"{seconds:.1f} s", file=sys.stderr, flush=True)  # fmt: skip


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, device: torch.device, rank: int) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.rank = rank
        self.block_size = config.cache.block_size
        mc = config.model
        self.max_blocks = -(-mc.max_model_len // self.block_size)
        # cuda_graphs="padded" keeps the device-side token feed ops, so CPU tests run the GPU's code path.
        numpy_feed = device.type == "cpu" and config.cuda_graphs != "padded"
        try:
            self.batch = PersistentBatch(
                config.scheduler.max_num_seqs, mc.max_model_len, self.max_blocks, mc.vocab_size, device,
                numpy_feed=numpy_feed,
            )  # fmt: skip
        except (MemoryError, torch.OutOfMemoryError) as exc:  # (a numpy array of rows x tokens first)
            raise ConfigError(
                f"the running batch's arrays for max_num_seqs={config.scheduler.max_num_seqs} rows of "
                f"max_model_len={mc.max_model_len} tokens could not be allocated ({type(exc).__name__}); "
                "lower max_num_seqs or max_model_len"
            ) from None
        self.attention = make_attention_backend(
            config.attention_backend, device, model.num_local_kv_heads, self.block_size,
            num_heads=mc.num_heads // config.parallel.tensor_parallel_size, head_dim=mc.head_dim,
            dtype=model.dtype,
        )  # fmt: skip
        self.inputs = InputBuilder(
            self.batch, self.block_size, self.attention, mc.sliding_window, mc.vocab_size, device
        )
        self._fused_sampling = pick_kernels(config.fused_kernels, device) == "triton"
        self.sampler = Sampler(device, config.seed, fused=self._fused_sampling)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedStepGraphs | None = None
        # Benchmark switch (set by a control call): wait for the sampled ids before the bookkeeping, the
        # order this runner replaced.
        self.sync_first = False
        self.collect_timings = False
        self._use_cuda = device.type == "cuda"
        self._last_forward_end: torch.cuda.Event | float | None = None
        self.grammar_masks = GrammarMasks(config.scheduler.max_num_seqs, mc.vocab_size, device)
        self._awaiting_mask: _AwaitingMask | None = None

    # ----------------------------------------------------------------- KV cache
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return kv_fp8.cache_dtype(self.config.cache.kv_cache_dtype, self.model.dtype)

    def kv_bytes_per_block(self) -> int:
        elem = self.kv_cache_dtype.itemsize
        per_layer = 2 * self.block_size * self.model.num_local_kv_heads * self.config.model.head_dim * elem
        return per_layer * self.config.model.num_layers

    def _captures_graphs(self) -> bool:
        return self.device.type == "cuda" and self.config.cuda_graphs == "auto"

    def mixed_graph_pool_bytes(self, profiled_activation_bytes: int) -> int:
        """What the mixed-step graphs will hold (made after the KV cache is allocated, so the cache must
        leave room for it): their pool, the activations of their largest bucket, estimated from the
        profiled prefill's by the ratio of their token counts, and the buffers their pieces share (0 when
        graphs are not captured)."""
        if not self._captures_graphs():
            return 0
        sched, mc = self.config.scheduler, self.config.model
        profiled = largest_prefill_chunks(sched.max_num_batched_tokens, sched.max_num_seqs, mc.max_model_len)
        graphed = min(sched.max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS)
        pool = int(profiled_activation_bytes * min(1.0, graphed / profiled[-1][1]))
        tp = self.config.parallel.tensor_parallel_size
        shared = MixedStepGraphs.static_bytes(
            graphed, mc.hidden_size, mc.num_heads // tp, self.model.num_local_kv_heads, mc.head_dim,
            self.model.dtype,
        )  # fmt: skip
        return pool + shared

    def decode_reserve_bytes(self) -> int:
        """What decoding holds beyond the profiled prefill. The gather path: the keys and values one layer
        gathers for a full batch at max_model_len, in the model dtype (an FP8 cache's bytes gathered first,
        then converted). The Triton kernels read the blocks in place: only the split-KV partials of the
        widest batch that splits (float32 sums per split, with their maximum and total). Either way, with
        CUDA graphs, the decode graphs' logits of every row, held outside the graphs' pool (counted at
        float32, the widest logits a model makes)."""
        rows = self.config.scheduler.max_num_seqs
        logits = rows * self.config.model.vocab_size * 4 if self._captures_graphs() else 0
        if self.attention.reads_table_padding:
            per_block_layer = self.kv_bytes_per_block() // self.config.model.num_layers
            cache_item = self.kv_cache_dtype.itemsize
            if cache_item != self.model.dtype.itemsize:
                per_block_layer = per_block_layer // cache_item * (cache_item + self.model.dtype.itemsize)
            return rows * self.max_blocks * per_block_layer + logits
        mc = self.config.model
        heads = mc.num_heads // self.config.parallel.tensor_parallel_size
        splits = ((r, self.attention.num_decode_splits(r, self.max_blocks)) for r in batch_buckets(rows))
        split_rows = max((r * n for r, n in splits if n > 1), default=0)  # one split writes no partials
        return split_rows * heads * (mc.head_dim + 2) * 4 + logits

    def allocate_kv_cache(self, num_blocks: int) -> None:
        dtype = self.kv_cache_dtype
        # One block more than the scheduler owns: the decode graphs' padding rows write into it.
        shape = (num_blocks + 1, self.block_size, self.model.num_local_kv_heads, self.config.model.head_dim)
        try:
            self.kv_caches = [
                (
                    torch.zeros(shape, dtype=dtype, device=self.device),
                    torch.zeros(shape, dtype=dtype, device=self.device),
                )
                for _ in range(self.config.model.num_layers)
            ]
        except RuntimeError as exc:
            # torch.OutOfMemoryError on a GPU, a plain RuntimeError from the CPU's allocator; any other
            # error (a CUDA fault) is not the cache's size
            if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(exc):
                raise
            self.kv_caches = []
            size = math.prod(shape) * dtype.itemsize * 2 * self.config.model.num_layers / 2**30
            raise ConfigError(
                f"the KV cache of {num_blocks} blocks of {self.block_size} tokens ({size:.2f} GiB a rank) "
                f"could not be allocated ({type(exc).__name__}); lower num_kv_blocks (or "
                "gpu_memory_utilization)"
            ) from exc
        mode = self.config.cuda_graphs
        if mode == "auto":
            mode = "capture" if self.device.type == "cuda" else "off"
        self.decode_graphs = None
        self.mixed_graphs = None
        if mode != "off":
            capture = mode == "capture"
            pool = torch.cuda.graph_pool_handle() if capture else None  # the two kinds share it
            trash_slot = num_blocks * self.block_size
            self.decode_graphs = DecodeGraphs(
                self._graph_forward, self.block_size, self.config.scheduler.max_num_seqs, self.max_blocks,
                trash_slot=trash_slot, device=self.device, capture=capture, token_feed=self.batch.token_feed,
                attention=self.attention, pool=pool, graph_pass=lambda: decode_graph_pass(self.model),
            )  # fmt: skip
            mc, tp = self.config.model, self.config.parallel.tensor_parallel_size
            max_tokens = min(self.config.scheduler.max_num_batched_tokens, MIXED_GRAPH_MAX_TOKENS)
            self.mixed_graphs = MixedStepGraphs(
                self._hidden_forward, max_tokens, mc.hidden_size, mc.num_heads // tp,
                self.model.num_local_kv_heads, mc.head_dim, self.model.dtype, trash_slot=trash_slot,
                device=self.device, capture=capture, token_feed=self.batch.token_feed,
                attention=self.attention, pool=pool, graph_pass=lambda: decode_graph_pass(self.model),
            )  # fmt: skip
        self.inputs.decode_graphs = self.decode_graphs
        self.inputs.mixed_graphs = self.mixed_graphs

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Before the first request: compile the Triton kernels a step can launch, run the eager attention
        and sampling kernels, and capture every CUDA graph, rank 0 showing progress on stderr. Nothing
        without capture."""
        decode, mixed = self.decode_graphs, self.mixed_graphs
        if decode is None or mixed is None or not decode.capture:
            return
        show = self.rank == 0
        # The same forwards twice: a dry pass that finds the Triton kernels and compiles them in parallel,
        # then the real warm-up and capture, which find them compiled (worker/kernel_precompile.py).
        threads = compile_threads(self.config.parallel.tensor_parallel_size)
        precompiler = KernelPrecompiler(self.device, threads)
        if precompiler.available:
            start = time.perf_counter()
            with precompiler.dry_pass():
                self._run_warm_ups()
            dry_s = time.perf_counter() - start
            report = precompiler.compile_all()
            if show and report.kernels:
                print(f"tp-runtime: found {report.kernels} Triton kernels in {dry_s:.1f} s and compiled "
                      f"them in {report.seconds:.1f} s ({threads} threads)", file=sys.stderr,
                      flush=True)  # fmt: skip
        progress = CaptureProgress(len(mixed.token_sizes), len(decode.shapes()), show=show)
        with precompiler.counting() as late:
            self._run_warm_ups(graphs=False)
            mixed.capture_all(progress.step)
            decode.capture_all(progress.step)
        torch.cuda.synchronize(self.device)
        progress.finish()
        if show and late.found:
            names = sorted({getattr(fn, "__name__", str(fn)) for fn, _ in late.found.values()})
            print(f"tp-runtime: warning: {len(late.found)} Triton kernels compiled one at a time during the "
                  f"warm-up, not ahead ({', '.join(names[:4])})", file=sys.stderr, flush=True)  # fmt: skip

    def _run_warm_ups(self, graphs: bool = True) -> None:
        """The eager kernels a step runs outside the graphs, and (`graphs`) each graph's warm-up forward."""
        self._run_attention_warm_up()
        self.sampler.warm_up(self.config.model.vocab_size)
        if graphs:
            assert self.mixed_graphs is not None and self.decode_graphs is not None
            self.mixed_graphs.run_warm_ups()
            self.decode_graphs.run_warm_ups()

    def _run_attention_warm_up(self) -> None:
        """Eager steps in the trash block (no sequence's cache is touched) that take each attention path a
        step runs outside the graphs: a decode row, a fresh prompt and a continuation chunk together, then a
        decode row at every split-KV count an eager step can pick (each is a kernel of its own)."""
        assert self.mixed_graphs is not None
        bs, trash_slot = self.block_size, self.mixed_graphs.trash_slot
        trash_block = trash_slot // bs
        n = max(1, min(bs, self.config.model.max_model_len // 2))  # each chunk's tokens
        num_tokens = 1 + 2 * n

        def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        def run(meta: AttentionMetadata, positions: torch.Tensor) -> None:
            ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
            self.model.compute_logits(self.model(ids, positions, self.kv_caches, meta)[-1:])

        fresh_table = ints([]) if self.config.model.sliding_window is None else ints([trash_block])
        slots = trash_slot + torch.arange(num_tokens, device=self.device) % bs
        run(AttentionMetadata(
            backend=self.attention, slot_mapping=slots,
            num_decode_tokens=1, decode_block_tables=ints([[trash_block]]), decode_seq_lens=ints([1]),
            decode_num_splits=self.attention.num_decode_splits(1, 1),
            prefills=[PrefillChunk(1, 1 + n, 0, fresh_table),
                      PrefillChunk(1 + n, num_tokens, n, ints([trash_block] * -(-2 * n // bs)))],
        ), ints([0, *range(n), *range(n, 2 * n)]))  # fmt: skip
        # One decode row sees every split count that any batch can (a single row splits the most).
        widths = {self.attention.num_decode_splits(1, b): b for b in range(self.max_blocks, 0, -1)}
        for splits, blocks in sorted(widths.items()):
            run(AttentionMetadata(
                backend=self.attention, slot_mapping=slots[:1], num_decode_tokens=1,
                decode_block_tables=ints([[trash_block] * blocks]), decode_seq_lens=ints([1]),
                decode_num_splits=splits,
            ), ints([0]))  # fmt: skip

    def _graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def _hidden_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _penalty_state(self) -> PenaltyState:
        """The batch's penalty state, or (before the first penalized request makes it, so that it is
        counted) one of its size."""
        if self.batch.penalties is not None:
            return self.batch.penalties
        return PenaltyState(len(self.batch.token_feed), self.batch.vocab_size, self.device)

    @torch.inference_mode()
    def profile_peak_memory(self) -> int:
        """Run the largest prefill a step can hold, then the largest sampling, once and return the peak
        device memory in bytes. The penalties' per-row token state is held through both: made for the
        first penalized request, it then stays beside every later step's prefill."""
        torch.cuda.reset_peak_memory_stats(self.device)
        penalties = self._penalty_state()
        self.run_largest_sampling(self.run_largest_prefill(), penalties)
        del penalties
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return int(peak)

    @torch.inference_mode()
    def run_largest_prefill(self) -> torch.Tensor:
        """One forward of the largest prefill step, into a one-block cache: fresh prompts of max_model_len
        tokens filling max_num_batched_tokens (their attention runs in batches, so several full-length
        prompts are in one call), and the logits of `logits_rows` rows, the most a step makes at once."""
        sched, cfg = self.config.scheduler, self.config.model
        kv_caches = self.kv_caches  # none before the cache is sized
        self.kv_caches = [
            (torch.zeros(1, self.block_size, self.model.num_local_kv_heads, cfg.head_dim,
                         dtype=self.kv_cache_dtype, device=self.device),) * 2
            for _ in range(cfg.num_layers)
        ]  # fmt: skip
        chunks = largest_prefill_chunks(sched.max_num_batched_tokens, sched.max_num_seqs, cfg.max_model_len)
        num_tokens = chunks[-1][1]
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(end - start, device=self.device) for start, end in chunks])
        slots = positions % self.block_size
        no_blocks = torch.zeros(0, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(
            backend=self.attention, slot_mapping=slots, num_decode_tokens=0,
            prefills=[PrefillChunk(start, end, 0, no_blocks) for start, end in chunks],
        )  # fmt: skip
        try:
            hidden = self.model(ids, positions, self.kv_caches, meta)
            # As many rows as a step's logits take at once: its sampled rows, or a slice of prompt logprobs.
            return self.model.compute_logits(hidden[-min(num_tokens, self.logits_rows) :])
        finally:
            self.kv_caches = kv_caches

    @torch.inference_mode()
    def run_largest_sampling(
        self, logits: torch.Tensor, penalties: PenaltyState | None = None
    ) -> SamplerOutput:
        """What a step allocates after its forward, at its largest, on the largest prefill's `logits`: one
        slice of prompt logprobs packed with max_logprobs top entries, then the sampler on as many rows as
        a step samples with every option that takes memory (penalties with their per-row token state,
        min-p, top-k, top-p, a seeded row, max_logprobs logprobs, min_tokens' stop ids masked in a copy,
        a grammar's allowed tokens).
        A sampler of its own draws the noise, so the engine's random stream is untouched. `penalties`:
        the token state to use (default: the batch's, or one made here)."""
        sched, k = self.config.scheduler, self.config.max_logprobs
        # Rank 0 packs a step's prompt logprobs and holds them while the step samples.
        packed = None
        if self.rank == 0:
            targets = torch.zeros(len(logits), dtype=torch.int64, device=self.device)
            packed = pack_prompt_logprobs(logits, targets, k)
        rows = min(sched.max_num_seqs, sched.max_num_batched_tokens, len(logits))
        if penalties is None:
            penalties = self._penalty_state()

        def full(value: float) -> torch.Tensor:
            return torch.full((rows,), value, dtype=torch.float32, device=self.device)

        rows_dev = torch.arange(rows, device=self.device)
        sampling = SamplingBatch(
            temperature=full(1.0), greedy=rows_dev < 0, all_greedy=False,
            top_k=torch.full_like(rows_dev, min(2, logits.shape[1])),
            top_p=full(0.9), min_p=full(0.1), row_seeds={0: 0}, max_num_logprobs=k,
            repetition_penalty=full(1.1), presence_penalty=full(0.1), frequency_penalty=full(0.1),
        )  # fmt: skip
        sampler = Sampler(self.device, 0, fused=self._fused_sampling)
        raw = logits[:rows].float()
        masked = raw.clone()  # as _process_logits makes (min_tokens, logit_bias, allowed_token_ids)
        # Structured outputs' allowed tokens of every row (GrammarMasks.allowed), alive through the sampler.
        allowed = torch.ones((rows, logits.shape[1]), dtype=torch.bool, device=self.device)
        sampled = sampler(masked, penalties.for_rows(sampling, rows_dev), raw=raw)
        del packed, allowed
        return sampled

    # ----------------------------------------------------------------- step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> PendingOutput | None:
        """Queue one step (inputs, forward, sampling) and return without waiting for the device. A step
        sent with grammar_mask_follows queues its forward and returns None: `apply_grammar_mask` then
        samples it."""
        if self._awaiting_mask is not None:
            waiting = self._awaiting_mask.so.step_id
            raise ProtocolError(f"step {so.step_id} arrived while step {waiting} waits for its grammar mask")
        timings: dict[str, float] | None = {} if self.collect_timings else None
        t0 = time.perf_counter()
        self.batch.update(so)
        if not so.scheduled_req_ids:
            if so.grammar_mask_follows:
                raise ProtocolError(f"step {so.step_id}: a grammar mask follows a step that runs nothing")
            return PendingOutput(step_id=so.step_id, req_ids=[], transfer=None, num_sampled=0)
        inputs = self.inputs.prepare(so)
        t_prep = time.perf_counter()
        forward_start = self._now_event(timings)
        logits, prompt_packed, rows_dev = self._forward(inputs)
        step = _AwaitingMask(so, inputs, logits, prompt_packed, rows_dev, t0, t_prep, forward_start, timings)
        if so.grammar_mask_follows:
            self._awaiting_mask = step
            return None
        return self._sample_and_finish(step, so.grammar_bitmask)

    @torch.inference_mode()
    def apply_grammar_mask(self, mask: GrammarMask) -> PendingOutput:
        """Sample the step waiting for this mask (see execute_model)."""
        step = self._awaiting_mask
        if step is None or step.so.step_id != mask.step_id:
            waiting = "no step" if step is None else f"step {step.so.step_id}"
            raise ProtocolError(
                f"a grammar mask for step {mask.step_id} arrived while {waiting} waits for one"
            )
        self._awaiting_mask = None
        return self._sample_and_finish(step, mask.bitmask)

    def _sample_and_finish(self, step: _AwaitingMask, bitmask: bytes) -> PendingOutput:
        so, inputs, logits, timings = step.so, step.inputs, step.logits, step.timings
        sampled = None
        if inputs.sampling is not None:
            allowed = self.grammar_masks.allowed(so.step_id, so.structured_req_ids, bitmask, inputs.req_ids)
            sampled = self._sample(logits, inputs.sampling, inputs.sample_rows, step.rows_dev, allowed)
        elif so.structured_req_ids:
            raise ProtocolError(f"step {so.step_id}: a grammar bitmask for a step where no request samples")
        plan = inputs.prompt_logprobs
        prompt = None if plan is None or step.prompt_packed is None else (step.prompt_packed, plan)
        forward_end = self._now_event(timings)
        t_dispatch = time.perf_counter()

        batch = self.batch
        if self.sync_first:
            # The order this project replaced: wait for the values, then do all bookkeeping.
            transfer = self._start_transfer(sampled, prompt, every_rank=True)
            if transfer is not None:
                transfer.wait()
            t_sync = time.perf_counter()
            batch.advance(inputs.scheduled_rows, inputs.num_scheduled, inputs.sample_rows)
            t_book = time.perf_counter()
            phases = {"sync_wait": t_sync - t_dispatch, "bookkeeping": t_book - t_sync}
        else:
            # Nothing here needs the sampled values, so it runs while the device computes; only rank 0
            # copies them to the host (the other ranks feed them to the next step on the device).
            batch.advance(inputs.scheduled_rows, inputs.num_scheduled, inputs.sample_rows)
            t_book = time.perf_counter()
            transfer = self._start_transfer(sampled, prompt, every_rank=False)
            phases = {"bookkeeping": t_book - t_dispatch}
        pending = PendingOutput(
            step_id=so.step_id, req_ids=inputs.req_ids, transfer=transfer, num_sampled=len(inputs.sample_rows)
        )
        if timings is not None:
            timings["prepare_inputs"] = step.t_prep - step.t0
            timings["forward_dispatch"] = t_dispatch - step.t_prep
            timings.update(phases)
            pending.timings = timings
            pending.device_marks = (self._last_forward_end, step.forward_start, forward_end)
            self._last_forward_end = forward_end
        return pending

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Logits of the rows that sample, the planned prompt positions' logprobs packed (rank 0; None
        elsewhere and without a plan), and the sampling rows' batch rows on the device."""
        plan = inputs.prompt_logprobs
        step = inputs.model
        if isinstance(step, GraphDecodeBatch):
            graphs = self.decode_graphs
            assert graphs is not None, "internal: graph inputs without decode graphs"
            all_logits = graphs.run(step)
            rows = graphs.batch_rows(len(step.input_ids))
            # Short prefill chunks run a row per token: their rows' logits are the prompt positions'.
            prompt = None
            if plan is not None and self.rank == 0:
                prompt = pack_prompt_logprobs(all_logits[plan.token_indices], plan.targets, plan.max_k)
            if inputs.logits_indices is None:
                return all_logits, prompt, rows
            # Only a chunk's last row samples, and only when the chunk finishes its prompt.
            return all_logits[inputs.logits_indices], prompt, rows[inputs.logits_indices]
        if isinstance(step, MixedStepBatch):
            assert self.mixed_graphs is not None, "internal: mixed-step inputs without their graphs"
            hidden = self.mixed_graphs.run(step)
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        prompt = None if plan is None else self._prompt_logprobs(hidden, plan)
        if inputs.logits_indices is not None:
            hidden = hidden.index_select(0, inputs.logits_indices)
        return self.model.compute_logits(hidden), prompt, step.sample_rows

    @property
    def logits_rows(self) -> int:
        """The most rows whose full-vocabulary logits a step makes at once (the memory profile makes as
        many): its sampled rows, at most max_num_seqs, or a slice of prompt logprobs."""
        sched = self.config.scheduler
        return min(max(sched.max_num_seqs, MIN_LOGITS_ROWS), sched.max_num_batched_tokens)

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: PromptLogprobPlan) -> torch.Tensor | None:
        """The planned prompt positions' logprobs, packed on rank 0, their full-vocabulary logits made
        `logits_rows` rows at a time, which the memory profile counts (a long prompt's every position at
        once would not fit it). Every rank runs the LM head, whose vocab-parallel form all-gathers."""
        rows = self.logits_rows
        packed = []
        for start in range(0, len(plan.token_indices), rows):
            part = slice(start, start + rows)
            logits = self.model.compute_logits(hidden.index_select(0, plan.token_indices[part]))
            if self.rank == 0:
                packed.append(pack_prompt_logprobs(logits, plan.targets[part], plan.max_k))
        return torch.cat(packed) if packed else None

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: SamplingBatch,
        rows: np.ndarray,
        rows_dev: torch.Tensor,
        allowed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample the rows' next tokens and keep them on the device as the rows' next inputs. `allowed`:
        structured outputs' (rows, [rows, vocab] bool) tokens those rows may sample. As in vLLM, the
        grammar's mask comes before everything else, the logprobs' raw logits included (a token the
        grammar forbids has logprob -inf; the others are normalized over the allowed ones)."""
        raw = logits.float()
        if allowed is not None:
            if raw is logits:
                raw = raw.clone()
            index, mask = allowed
            raw[index] = raw[index].masked_fill(~mask, float("-inf"))
        logits = self._process_logits(raw, rows)
        penalties = self.batch.penalties if sampling.penalized else None
        if penalties is not None:
            sampling = penalties.for_rows(sampling, rows_dev)
        sampled = self.sampler(logits, sampling, raw=raw)
        if penalties is not None:
            penalties.count(rows_dev, sampled.token_ids)
        self.batch.feed(rows, rows_dev, sampled.token_ids)
        return sampled

    def _process_logits(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The logits the penalties and the sampler start from: bad_words' banned tokens at -inf; before
        min_tokens outputs exist, EOS and stop_token_ids at -inf; logit_bias added, tokens outside
        allowed_token_ids at -inf. A copy where any row changes (the logprobs are the raw logits')."""
        batch = self.batch
        pending = np.flatnonzero(batch.num_output[rows] < batch.min_tokens[rows])
        biased = np.flatnonzero(batch.has_token_bias[rows])
        banned = np.flatnonzero(batch.has_bad_words[rows])
        masked = logits if not len(biased) and not len(banned) else logits.clone()
        if len(banned):
            words = [batch.bad_words[rows[i]] for i in banned.tolist()]
            apply_bad_words(masked, banned, words, rows[banned], batch.recent)
        for i in pending.tolist():
            stops = batch.stop_tokens[rows[i]]
            if stops is not None:
                if masked is logits:
                    masked = logits.clone()
                stops.mask(masked[i])
        if len(biased):
            apply_token_biases(masked, biased, [batch.token_bias[rows[i]] for i in biased.tolist()])
        return masked

    def _start_transfer(
        self,
        sampled: SamplerOutput | None,
        prompt: tuple[torch.Tensor, PromptLogprobPlan] | None,
        every_rank: bool,
    ) -> HostTransfer | None:
        """Rank 0 (every rank with `every_rank`) copies the step's values to the host; logprobs only on
        rank 0, the only one that replies."""
        if (sampled is None and prompt is None) or (self.rank != 0 and not every_rank):
            return None
        return start_host_transfer(sampled, prompt, with_logprobs=self.rank == 0, use_cuda=self._use_cuda)

    def _now_event(self, timings: dict[str, float] | None) -> torch.cuda.Event | float | None:
        """A point in the step's device timeline: a CUDA event on GPU, wall time on CPU (where the
        forward runs synchronously). None when timings are off."""
        if timings is None:
            return None
        if self._use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
