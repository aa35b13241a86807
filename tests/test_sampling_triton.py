"""The Triton race/argmax kernels (worker/sampling_triton.py) in Triton's interpreter against the PyTorch
form in sampler.py on the same noise, and the fused Sampler against the unfused one."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

SCRIPT = """
import torch
from tp_runtime.worker import sampling_triton
from tp_runtime.worker.sampler import Sampler, SamplingBatch, filter_logits, race_argmax
g = torch.Generator().manual_seed(0)
checked = 0
# Vocabularies shorter than a block, a whole number of chunks, and a ragged last chunk.
for vocab in (5, 1000, 2 * sampling_triton.CHUNK, 3 * sampling_triton.CHUNK + 77):
    for rows in (1, 3):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
            greedy = torch.tensor([r % 2 == 1 for r in range(rows)])
            temperature = torch.rand(rows, generator=g) + 0.5
            noise = torch.rand(rows, vocab, generator=g)
            want = race_argmax(logits.float(), greedy, noise.clone(), temperature)
            got = sampling_triton.race_argmax(logits, greedy, noise.clone(), temperature)
            assert torch.equal(got, want), (vocab, rows, dtype, got, want)
            assert torch.equal(sampling_triton.race_argmax(logits), logits.float().argmax(-1))
            # Filtered scores: removed tokens are -inf and never drawn.
            removed = torch.rand(rows, vocab, generator=g) < 0.7
            scores = (logits.float() / temperature.unsqueeze(1)).masked_fill(removed, float("-inf"))
            scores[:, 0] = 0.0  # one token always kept
            want = race_argmax(logits.float(), greedy, noise.clone(), temperature, scores)
            got = sampling_triton.race_argmax(logits, greedy, noise.clone(), temperature, scores)
            assert torch.equal(got, want), (vocab, rows, dtype, "filtered")
            assert all(torch.isfinite(scores[r, got[r]]) for r in range(rows) if not greedy[r])
            checked += 1
# Ties go to the lowest index, as torch.argmax's, also across chunks; a row of -inf gives 0.
vocab = 3 * sampling_triton.CHUNK
tied = torch.zeros(3, vocab)
tied[0, [7, sampling_triton.CHUNK + 1, vocab - 1]] = 5.0
tied[1, [vocab - 1, sampling_triton.CHUNK]] = 5.0
tied[2] = float("-inf")
assert sampling_triton.race_argmax(tied).tolist() == [7, sampling_triton.CHUNK, 0] == tied.argmax(-1).tolist()
# The Sampler with the kernels draws what the PyTorch Sampler draws (same seeds, same noise).
logits = torch.randn(6, 3000, generator=g) * 2
def batch(**kw):
    rows = 6
    return SamplingBatch(temperature=torch.full((rows,), 0.9), greedy=torch.tensor([False] * 5 + [True]),
                         all_greedy=False, top_k=kw.get("top_k"), top_p=None, min_p=None,
                         row_seeds={1: 77}, max_num_logprobs=-1)
for top_k in (None, torch.full((6,), 20)):
    a = Sampler(torch.device("cpu"), seed=3)(logits, batch(top_k=top_k)).token_ids
    fused = Sampler(torch.device("cpu"), seed=3, fused=True)
    fused.warm_up(3000)  # every kernel variant run once; the engine's random stream untouched
    b = fused(logits, batch(top_k=top_k)).token_ids
    assert torch.equal(a, b), (a, b)
    checked += 1
try:
    sampling_triton.race_argmax(logits, noise=torch.rand(6, 3000))
except ValueError as e:
    assert "greedy mask" in str(e)
else:
    raise AssertionError("sampling without a greedy mask was accepted")
print("OK", checked)
"""


def test_race_kernels_match_pytorch() -> None:
    status, checked = run_interpreted(SCRIPT).split()
    assert status == "OK" and int(checked) == 4 * 2 * 2 + 2
