"""Engine-level limits and failure edges, checked against HF transformers' greedy continuations.

Each test builds small in-process (TP=1) engines on one tiny random Llama checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import hf_greedy, hf_logprobs, random_prompts

from tp_runtime import LLM, SamplingParams, StructuredOutputsParams
from tp_runtime.errors import ConfigError

VOCAB = 300  # conftest's BASE_CONFIG


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM")


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(model=model_dir, dtype="float32", device="cpu", seed=0, **kwargs)


def generate_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def fail_forward_at(llm: LLM, monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Make the in-process model's forward raise part-way (after its first decoder layer wrote its keys and
    values, before the second did) on its `call`-th step, as a Ctrl-C or an out-of-memory error would."""
    layer = llm.engine.executor.worker.runner.model.model.layers[1]
    forward, calls = layer.forward, [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("injected failure inside the forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(layer, "forward", failing)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_after_a_failed_prefill_is_computed_not_taken_from_the_cache(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """The scheduler registers a step's full blocks in the prefix cache when it schedules the step; a
    forward that failed part-way left them registered with keys and values never written, so the same
    prompts afterwards (a retry after Ctrl-C or an OOM) hit them and generated wrong tokens for good."""
    prompts = random_prompts((40, 33), VOCAB, seed=77)
    want = hf_greedy(model_dir, prompts, 6)
    llm = make_llm(model_dir, block_size=8, max_model_len=64, async_scheduling=async_scheduling)
    with llm:
        fail_forward_at(llm, monkeypatch, call=1)
        with pytest.raises(RuntimeError, match="injected failure"):
            generate_ids(llm, prompts, 6)
        monkeypatch.undo()
        assert generate_ids(llm, prompts, 6) == want
        assert generate_ids(llm, prompts, 6) == want  # now from blocks that were computed


def test_block_filled_by_a_failed_decode_step_is_not_cached(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without async scheduling a decode step's token is known when it is scheduled, so the block it fills
    is registered then: a failed decode step must not leave it behind for a prompt that extends the
    output. One position of missing keys moves the logprobs (by ~0.04 here) before it flips a token."""
    prompt = random_prompts((39,), VOCAB, seed=78)[0]
    want = hf_greedy(model_dir, [prompt], 6)[0]
    llm = make_llm(model_dir, block_size=8, max_model_len=64, async_scheduling=False)
    with llm:
        fail_forward_at(llm, monkeypatch, call=2)  # the first decode step computes position 39
        with pytest.raises(RuntimeError, match="injected failure"):
            generate_ids(llm, [prompt], 6)
        monkeypatch.undo()
        # Its first 40 tokens fill 5 blocks of 8, all of which a 41-token prompt may take from the cache.
        longer = prompt + want[:2]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
        out = llm.generate({"prompt_token_ids": longer}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == want[2:]
    assert out.logprobs is not None
    hf = hf_logprobs(model_dir, longer, want[2:])
    got = [entry[token].logprob for entry, token in zip(out.logprobs, want[2:], strict=True)]
    want_lp = [hf[i, token].item() for i, token in enumerate(want[2:])]
    assert got == pytest.approx(want_lp, abs=1e-4)


def test_requests_freed_by_a_step_that_never_ran_are_freed_on_the_worker(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step carries the ids of the requests that ended since the last one, for the ranks to drop their
    rows; when it failed before reaching them (an exception or Ctrl-C before the rank took it) those ids
    were lost, the rows stayed, and once they filled max_num_seqs a later generate died in an IndexError
    inside the persistent batch."""
    prompts = random_prompts((5, 9, 12, 7), VOCAB, seed=2)
    want = hf_greedy(model_dir, prompts, 4)
    llm = make_llm(model_dir, block_size=8, max_model_len=64, max_num_seqs=2)
    with llm:
        executor = llm.engine.executor
        submit = executor.submit

        def failing(so: Any) -> None:
            if so.freed_req_ids:  # the step after a request ended, before any rank saw it
                raise RuntimeError("injected failure before the step was sent")
            submit(so)

        assert generate_ids(llm, prompts[:1], 2) == [want[0][:2]]  # its row is dropped with the next step
        monkeypatch.setattr(executor, "submit", failing)
        with pytest.raises(RuntimeError, match="injected failure"):
            generate_ids(llm, prompts[1:2], 2)
        monkeypatch.undo()
        assert generate_ids(llm, prompts, 4) == want


def test_too_few_kv_blocks_given_says_to_raise_num_kv_blocks(model_dir: Path) -> None:
    """num_kv_blocks fixes the cache's size, so the memory settings the message used to suggest
    (gpu_memory_utilization, cpu_kv_cache_gib) changed nothing."""
    with pytest.raises(ConfigError, match="raise num_kv_blocks to at least 8") as err:
        make_llm(model_dir, block_size=8, max_model_len=64, num_kv_blocks=7)
    assert "gpu_memory_utilization" not in str(err.value)
    with pytest.raises(ConfigError, match=r"give the cache more memory \(gpu_memory_utilization"):
        make_llm(model_dir, block_size=8, max_model_len=64, cpu_kv_cache_gib=1e-6)


def test_a_failure_while_a_grammar_mask_is_made_does_not_wedge_the_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling a constrained step's mask follows it, made while its forward runs; a failure
    (a Ctrl-C) while the driver made it left the in-process rank waiting for that mask for good, and every
    later generate raised 'ProtocolError: step 3 arrived while step 2 waits for its grammar mask'."""
    prompt = random_prompts((6,), VOCAB, seed=5)[0]
    want = hf_greedy(model_dir, [prompt], 3)
    choices = ["yes", "no", "maybe so"]
    constrained = SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    llm = make_llm(model_dir, max_model_len=64, async_scheduling=True)
    with llm:
        engine = llm.engine
        make_mask, calls = engine._grammar_bitmask, [0]

        def failing(rows: Any) -> bytes:
            calls[0] += 1
            if calls[0] == 2:  # the mask of the first decode step, while the prefill's output is handled
                raise RuntimeError("injected failure while making the mask")
            return make_mask(rows)

        monkeypatch.setattr(engine, "_grammar_bitmask", failing)
        with pytest.raises(RuntimeError, match="injected failure"):
            llm.generate([{"prompt_token_ids": prompt}], constrained, use_tqdm=False)
        monkeypatch.undo()
        out = llm.generate([{"prompt_token_ids": prompt}], constrained, use_tqdm=False)[0].outputs[0]
        assert out.text in choices
        assert generate_ids(llm, [prompt], 3) == want


def test_sampling_lists_are_bounded_so_every_step_reaches_the_workers(model_dir: Path) -> None:
    """bad_words, logit_bias, allowed_token_ids and stop_token_ids travel to every worker with each request.
    Past messages.sampling_ids_limit a request is refused, naming its largest list (2,000 distinct bad
    words: about 3,000 more ids than a tiny vocabulary's limit; unchecked, one ~1 MB request took a TP=2
    engine down: libzmq dropped the step past the workers' message limit). Repeated words are one; at the
    limit, a step of such requests at TP=2 runs, and its tokens equal TP=1's."""
    from tp_runtime.errors import InvalidRequestError

    many = [f"w{i}x" for i in range(2000)]
    with make_llm(model_dir, tensor_parallel_size=2) as llm:
        refused = r"hold \d+ token ids together.* over the 5296"
        with pytest.raises(InvalidRequestError, match=refused) as caught:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, bad_words=many), use_tqdm=False)
        assert caught.value.field == "bad_words"
        repeated = SamplingParams(temperature=0, max_tokens=6, bad_words=["ab"] * 100_000, ignore_eos=True)
        once = SamplingParams(temperature=0, max_tokens=6, bad_words=["ab"], ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in random_prompts((5, 9), VOCAB, seed=3)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, repeated, use_tqdm=False)]
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, once, use_tqdm=False)]
        # Whole-vocabulary lists (the most a request may send but bad words), four requests in one step.
        full = SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True, min_tokens=1, stop_token_ids=list(range(3, VOCAB)),
            logit_bias={t: 0.5 for t in range(VOCAB)}, allowed_token_ids=list(range(VOCAB)),
            bad_words=many[:100],
        )  # fmt: skip
        batch = [{"prompt_token_ids": p} for p in random_prompts((4, 6, 8, 5), VOCAB, seed=4)]
        tp2 = [o.outputs[0].token_ids for o in llm.generate(batch, full, use_tqdm=False)]
    with make_llm(model_dir) as llm:
        assert tp2 == [o.outputs[0].token_ids for o in llm.generate(batch, full, use_tqdm=False)]
