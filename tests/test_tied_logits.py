"""Tokens whose logits tie exactly (common with bf16 logits, whose values are coarse), against HF.

- Logprob ranks, against HF's log-softmax and vLLM's rule: the top-k entries are ranked 1..k in order, and
  a chosen token (sampled, or the prompt's) outside them is ranked after every token at least as likely
  (vLLM counts `logprobs >= chosen`). So a position's ranks are distinct, each a place the token may take
  in a most-likely-first order, and exactly k entries have rank <= k (what top_logprobs=k lists).
- top_k keeps every token tied with the k-th, as HF's TopKLogitsWarper (the reference) and vLLM do.

The model is a tiny random checkpoint whose LM head gives two tokens the same row: their logits are equal
at every position, and the pair ties for the most likely token after PROMPT.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tp_runtime import LLM, SamplingParams
from tp_runtime.outputs import Logprob

PROMPT = [1, 57, 201, 33, 90, 14]


@pytest.fixture(scope="module")
def tied(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, int, int]:
    """(checkpoint, its HF model, and the most likely token after PROMPT and its twin, a neighbouring id
    with the same LM-head row, the lower id first)."""
    source = make_checkpoint(seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        top = int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())
        # Its neighbour: a CPU matmul may sum some output columns (a tail block) in another order than
        # others, so that two equal rows far apart need not give equal logits; neighbours share a path.
        twin = top ^ 1
        model.lm_head.weight[twin] = model.lm_head.weight[top]
    out = tmp_path_factory.mktemp("tied")
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out, model, min(top, twin), max(top, twin)


def check_position(entry: dict[int, Logprob], row: torch.Tensor, chosen: int, k: int) -> None:
    """One position's logprobs against HF's `row` (log-softmax): the values, and ranks by the rule above."""
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(float(row[tid]), abs=1e-4), tid
        ahead, at_least = int((row > row[tid]).sum()), int((row >= row[tid]).sum())
        assert lp.rank is not None and ahead < lp.rank <= at_least, (tid, lp.rank, ahead, at_least)
    ranks = [lp.rank or 0 for lp in entry.values()]
    assert len(set(ranks)) == len(ranks), f"ranks repeat: {entry}"
    assert sum(rank <= k for rank in ranks) == k, f"not {k} entries ranked <= {k}: {entry}"
    if (entry[chosen].rank or 0) > k:
        assert entry[chosen].rank == int((row >= row[chosen]).sum())


@pytest.mark.parametrize("k", [0, 1, 3])
def test_tied_tokens_get_distinct_ranks(tied: tuple[Path, Any, int, int], k: int) -> None:
    model_dir, model, first, second = tied
    with torch.no_grad():
        ref = model(torch.tensor([[*PROMPT, second]])).logits[0].float().log_softmax(-1)
    assert float(ref[len(PROMPT) - 1, first]) == float(ref[len(PROMPT) - 1, second])
    assert int(ref[len(PROMPT) - 1].argmax()) in (first, second)
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        for token in (first, second):  # either twin sampled (allowed alone), greedy
            params = SamplingParams(temperature=0, max_tokens=1, logprobs=k, allowed_token_ids=[token])
            out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == [token] and out.logprobs is not None
            check_position(out.logprobs[0], ref[len(PROMPT) - 1], token, k)
        # The prompt's last token is the twin that top-k may list second.
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
        got = llm.generate({"prompt_token_ids": [*PROMPT, second]}, params, use_tqdm=False)[0].prompt_logprobs
        assert got is not None and got[-1] is not None
        check_position(got[-1], ref[len(PROMPT) - 1], second, k)


def test_top_k_samples_every_token_tied_with_the_kth(tied: tuple[Path, Any, int, int]) -> None:
    """top_k=1 with the top two tied: HF's TopKLogitsWarper keeps both, so seeded draws take each."""
    model_dir, model, first, second = tied
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1:]
    support = torch.isfinite(transformers.TopKLogitsWarper(top_k=1)(None, logits)[0]).nonzero().flatten()
    assert support.tolist() == [first, second]
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        params = SamplingParams(temperature=1.0, top_k=1, seed=0, n=32, max_tokens=1)
        outs = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs
    assert {out.token_ids[0] for out in outs} == {first, second}
