"""The persistent batch against a brute-force model: requests join and leave in a random order, and after
every step each column of each live request's row, host and device, equals that of a batch that holds the
request alone (in row 0, never moved) and went through the same steps. Columns are compared generically,
from PersistentBatch.columns() and device_columns(), so a new column is covered without changing this test.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tp_runtime.messages import CachedRequests, NewRequest, RequestSampling, SchedulerOutput
from tp_runtime.worker.persistent_batch import PersistentBatch

CPU = torch.device("cpu")
MAX_ROWS, MAX_MODEL_LEN, MAX_BLOCKS, VOCAB = 8, 40, 10, 50


def new_batch(rows: int, numpy_feed: bool) -> PersistentBatch:
    return PersistentBatch(rows, MAX_MODEL_LEN, MAX_BLOCKS, VOCAB, CPU, numpy_feed=numpy_feed)


def random_request(rng: random.Random, req_id: int) -> NewRequest:
    num_output = rng.choice([0, 0, rng.randint(1, 3)])  # a resumed (preempted) request brings outputs
    n = rng.randint(num_output + 1, 20)
    sampling = RequestSampling(
        temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 5]),
        min_p=rng.choice([0.0, 0.1]), seed=rng.choice([None, rng.randrange(2**40)]),
        min_tokens=rng.randint(0, 3), stop_token_ids=rng.sample(range(VOCAB), rng.randint(0, 3)),
        num_logprobs=rng.choice([-1, 0, 2]), repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]), frequency_penalty=rng.choice([0.0, 0.0, -0.4]),
        num_prompt_logprobs=rng.choice([-1, -1, 2]),
        logit_bias_ids=(bias_ids := sorted(rng.sample(range(VOCAB), rng.choice([0, 0, 3])))),
        logit_bias_values=[rng.uniform(-5, 5) for _ in bias_ids],
        allowed_token_ids=sorted(rng.sample(range(VOCAB), rng.choice([0, 0, 7]))),
    )  # fmt: skip
    return NewRequest(
        req_id=req_id, token_ids=[rng.randrange(VOCAB) for _ in range(n)], num_output_tokens=num_output,
        sampling=sampling, block_ids=[rng.randrange(100) for _ in range(rng.randint(0, 4))],
    )  # fmt: skip


def step(batch: PersistentBatch, rows: list[int], num_scheduled: list[int], sampled: dict[int, int]) -> None:
    """What a step does to its rows that needs no forward: bookkeeping, sampled ids kept on the device as
    the next inputs, and penalty counts."""
    sample_rows = np.array(list(sampled), dtype=np.int64)
    batch.advance(np.array(rows, dtype=np.int64), np.array(num_scheduled, dtype=np.int64), sample_rows)
    if not sampled:
        return
    ids = torch.tensor(list(sampled.values()), dtype=torch.int64)
    rows_dev = torch.from_numpy(sample_rows)
    batch.feed(sample_rows, rows_dev, ids)
    if batch.penalties is not None:
        batch.penalties.count(rows_dev, ids)


def check(batch: PersistentBatch, model: dict[int, PersistentBatch]) -> None:
    assert sorted(batch.row_of) == sorted(model)
    assert [batch.row_of[r] for r in batch.req_at] == list(range(len(model)))  # rows dense
    assert batch.prompt_logprob_reqs == set().union(*(m.prompt_logprob_reqs for m in model.values()))
    for req_id, alone in model.items():
        row = batch.row_of[req_id]
        for col in PersistentBatch.columns():
            got, want = getattr(batch, col.name)[row], getattr(alone, col.name)[0]
            if col.length is not None:  # a 2-D column: only its first `length` values are meaningful
                n = getattr(alone, col.length)[0]
                got, want = got[:n], want[:n]
            np.testing.assert_array_equal(got, want, err_msg=f"request {req_id}, column {col.name}")
        got_dev, want_dev = batch.device_columns(row), alone.device_columns(0)
        assert len(got_dev) == len(want_dev), f"request {req_id}: device columns"
        for i, (g, w) in enumerate(zip(got_dev, want_dev, strict=True)):
            np.testing.assert_array_equal(
                np.asarray(g[row]), np.asarray(w[0]), err_msg=f"request {req_id}, device column {i}"
            )


@pytest.mark.parametrize("numpy_feed", [True, False], ids=["numpy-feed", "device-feed"])
@pytest.mark.parametrize("seed", range(4))
def test_rows_match_a_dict_of_requests(seed: int, numpy_feed: bool) -> None:
    rng = random.Random(seed)
    batch = new_batch(MAX_ROWS, numpy_feed)
    model: dict[int, PersistentBatch] = {}  # live request -> a batch holding it alone, in row 0
    next_id = 0
    for step_id in range(150):
        live = list(model)
        freed = rng.sample(live, rng.randint(0, len(live))) if rng.random() < 0.5 else []
        kept = [r for r in live if r not in freed]
        new = [random_request(rng, next_id + i) for i in range(rng.randint(0, MAX_ROWS - len(kept)))]
        next_id += len(new)
        grown = [r for r in kept if rng.random() < 0.3]
        new_blocks = [
            [rng.randrange(100) for _ in range(rng.randint(0, MAX_BLOCKS - int(model[r].num_blocks[0])))]
            for r in grown
        ]
        batch.update(SchedulerOutput(
            step_id=step_id, new_requests=new, cached_requests=CachedRequests(grown, new_blocks),
            scheduled_req_ids=[], num_scheduled_tokens=[], freed_req_ids=freed,
        ))  # fmt: skip
        for r in freed:
            del model[r]
        for req in new:
            model[req.req_id] = new_batch(1, numpy_feed)
            model[req.req_id].add(req)
        for r, blocks in zip(grown, new_blocks, strict=True):
            if blocks:
                model[r].append_blocks(0, blocks)
        check(batch, model)

        running = [r for r in model if rng.random() < 0.7]
        num_scheduled = {r: rng.randint(1, 3) for r in running}
        sampled = {r: rng.randrange(VOCAB) for r in running if rng.random() < 0.6}
        step(batch, [batch.row_of[r] for r in running], list(num_scheduled.values()),
             {batch.row_of[r]: t for r, t in sampled.items()})  # fmt: skip
        for r in running:
            step(model[r], [0], [num_scheduled[r]], {0: sampled[r]} if r in sampled else {})
        check(batch, model)
