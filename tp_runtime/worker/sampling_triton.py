"""The last step of sampling as two Triton kernels: each row's greedy token (the first argmax of its
logits) and its sampled token (the exponential race: the first argmax of scores - log(-log U) over uniform
noise U, scores being logits / temperature or the filtered scores; see sampler.py).

PyTorch's argmax and softmax give each row to one block of threads: at batch 1 over a 128K vocabulary
each took ~30 µs on an H200, about 0.1 ms of a decode step together. Here every row is cut into chunks
of CHUNK tokens, one program each, and a second kernel combines the chunks' winners, ties going to the
lowest index as in torch.argmax. Only used on CUDA; `TRITON_INTERPRET=1` runs it on CPU tensors for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
BLOCK = 1024


@triton.jit
def _best(values, cols, best, best_idx):
    """Fold a tile into a running (max, first index of the max): a later tile wins only if strictly larger."""
    m = tl.max(values, axis=0)
    i = tl.min(tl.where(values == m, cols, 2147483647), axis=0)
    better = m > best
    return tl.where(better, m, best), tl.where(better, i, best_idx)


@triton.jit
def _race_chunk_kernel(
    logits_ptr, scores_ptr, noise_ptr, temperature_ptr, best_ptr, index_ptr,
    vocab, logits_stride, scores_stride, noise_stride, num_chunks,
    SAMPLE: tl.constexpr, SCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk): the chunk's greedy and race winners into best/index [rows, num_chunks, 2]."""
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2**31 (many rows of a large vocabulary)
    chunk = tl.program_id(1)
    start = chunk * CHUNK
    greedy_best = float("-inf")
    greedy_idx = start
    race_best = float("-inf")
    race_idx = start
    if SCALE:
        temperature = tl.load(temperature_ptr + row)
    for offset in range(0, CHUNK, BLOCK):
        cols = start + offset + tl.arange(0, BLOCK)
        mask = cols < vocab
        logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=float("-inf"))
        logits = logits.to(tl.float32)
        greedy_best, greedy_idx = _best(logits, cols, greedy_best, greedy_idx)
        if SAMPLE:
            if SCALE:
                scores = tl.math.div_rn(logits, temperature)  # IEEE division, as PyTorch's
            else:
                scores = tl.load(scores_ptr + row * scores_stride + cols, mask=mask, other=float("-inf"))
            u = tl.load(noise_ptr + row * noise_stride + cols, mask=mask, other=0.5)
            race = tl.where(mask, scores - tl.log(-tl.log(u)), float("-inf"))
            race_best, race_idx = _best(race, cols, race_best, race_idx)
    out = (row * num_chunks + chunk) * 2
    tl.store(best_ptr + out, greedy_best)
    tl.store(index_ptr + out, greedy_idx)
    tl.store(best_ptr + out + 1, race_best)
    tl.store(index_ptr + out + 1, race_idx)


@triton.jit
def _race_combine_kernel(
    best_ptr, index_ptr, greedy_ptr, out_ptr, num_chunks, SAMPLE: tl.constexpr, CHUNKS_BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_BLOCK)
    mask = c < num_chunks
    base = (row.to(tl.int64) * num_chunks + c) * 2
    best = tl.load(best_ptr + base, mask=mask, other=float("-inf"))
    index = tl.load(index_ptr + base, mask=mask, other=2147483647)
    m = tl.max(best, axis=0)
    token = tl.min(tl.where(mask & (best == m), index, 2147483647), axis=0)
    if SAMPLE:
        best = tl.load(best_ptr + base + 1, mask=mask, other=float("-inf"))
        index = tl.load(index_ptr + base + 1, mask=mask, other=2147483647)
        m = tl.max(best, axis=0)
        sampled = tl.min(tl.where(mask & (best == m), index, 2147483647), axis=0)
        token = tl.where(tl.load(greedy_ptr + row) != 0, token, sampled)
    tl.store(out_ptr + row, token.to(tl.int64))


def race_argmax(
    logits: torch.Tensor,
    greedy: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids [rows] int64. Without noise: argmax(logits) per row. With noise [rows, vocab] (uniform in
    [0, 1)): rows where `greedy` holds take argmax(logits), the others argmax(s - log(-log noise)), s being
    `scores` when given (filtered, already divided by the temperature) or logits / `temperature` [rows]."""
    rows, vocab = logits.shape
    for t in (logits, noise, scores):
        if t is not None and (t.shape != (rows, vocab) or t.stride(1) != 1):
            raise ValueError(f"logits, noise and scores must be [{rows}, {vocab}] with unit column stride")
    if vocab >= 2**31:
        raise ValueError(f"vocabulary of {vocab} tokens is too large for int32 indices")
    sample = noise is not None
    if sample and (greedy is None or (scores is None and temperature is None)):
        raise ValueError("sampling needs the greedy mask and either scores or temperatures")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    best = torch.empty((rows, num_chunks, 2), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, num_chunks, 2), dtype=torch.int32, device=logits.device)
    src_scores = scores if scores is not None else logits
    src_noise = noise if noise is not None else logits
    _race_chunk_kernel[(rows, num_chunks)](
        logits, src_scores, src_noise, temperature if temperature is not None else logits, best, index,
        vocab, logits.stride(0), src_scores.stride(0), src_noise.stride(0), num_chunks,
        SAMPLE=sample, SCALE=sample and scores is None, CHUNK=CHUNK, BLOCK=BLOCK,
    )  # fmt: skip
    _race_combine_kernel[(rows,)](
        best, index, greedy if greedy is not None else out, out, num_chunks, SAMPLE=sample,
        CHUNKS_BLOCK=max(16, triton.next_power_of_2(num_chunks)),
    )  # fmt: skip
    return out
