"""A step's output on its way to the host: the one device->host copy and the output built from it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tp_runtime.messages import (
    Logprobs,
    ModelRunnerOutput,
    PromptLogprobs,
)
from tp_runtime.worker.inputs import PromptLogprobPlan
from tp_runtime.worker.sampler import SamplerOutput


def pack_prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, max_k: int) -> torch.Tensor:
    """Raw-logit logprobs of prompt positions (`targets`: the token each predicts), packed for one copy
    (float64 holds every id exactly): [prompt token, its rank, its logprob, top-k ids, top-k logprobs]."""
    logprobs = logits.float().log_softmax(dim=-1)
    targets = targets.unsqueeze(1)
    target_lp = logprobs.gather(1, targets)
    ranks = (logprobs >= target_lp).sum(dim=-1, keepdim=True)  # as the sampler's (vLLM's, ties last)
    columns = [targets, ranks, target_lp]
    if max_k:
        top_lp, top_ids = logprobs.topk(max_k, dim=-1)
        columns += [top_ids, top_lp]
    return torch.cat([c.double() for c in columns], dim=1)


@dataclass
class HostTransfer:
    """Sampled values on their way to host memory; `done` is None when they are already there (CPU)."""

    host: torch.Tensor | None  # None when nothing sampled (a step of partial prefill chunks)
    done: torch.cuda.Event | None
    num_logprobs: int  # 1 + k columns of logprobs in a packed transfer; 0 for ids only
    prompt: torch.Tensor | None = None  # packed by pack_prompt_logprobs
    prompt_plan: PromptLogprobPlan | None = None

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None

    def ready(self) -> bool:
        return self.done is None or bool(self.done.query())

    def values(self) -> tuple[list[int], Logprobs | None]:
        self.wait()
        if self.host is None:
            return [], None
        if not self.num_logprobs:
            return self.host.tolist(), None
        k = self.num_logprobs
        packed = self.host.tolist()
        return [int(r[0]) for r in packed], Logprobs(
            token_ids=[[int(x) for x in r[2 : 2 + k]] for r in packed],
            logprobs=[r[2 + k :] for r in packed],
            sampled_ranks=[int(r[1]) for r in packed],
        )

    def prompt_logprobs(self) -> list[PromptLogprobs] | None:
        """Per request, trimmed to the k it asked for."""
        if self.prompt is None or self.prompt_plan is None:
            return None
        self.wait()
        packed = self.prompt.tolist()
        width = self.prompt_plan.max_k
        out, i = [], 0
        for req_id, first, count, k in self.prompt_plan.chunks:
            part, i = packed[i : i + count], i + count
            out.append(PromptLogprobs(
                req_id=req_id, start=first,
                token_ids=[[int(r[0]), *(int(x) for x in r[3 : 3 + k])] for r in part],
                logprobs=[[r[2], *r[3 + width : 3 + width + k]] for r in part],
                ranks=[int(r[1]) for r in part],
            ))  # fmt: skip
        return out


def start_host_transfer(
    sampled: SamplerOutput | None,
    prompt: tuple[torch.Tensor, PromptLogprobPlan] | None,
    with_logprobs: bool,
    use_cuda: bool,
) -> HostTransfer:
    """Start a step's device->host copies, waited for with one event: the sampled ids (packed with their
    logprobs when a row asked for them and `with_logprobs`), and the packed prompt logprobs."""
    num_logprobs = 0
    values: torch.Tensor | None
    if sampled is None:
        values = None
    elif sampled.logprobs is None or not with_logprobs:
        values = sampled.token_ids
    else:
        assert sampled.logprob_token_ids is not None and sampled.sampled_ranks is not None
        num_logprobs = sampled.logprobs.shape[1]
        # float64 holds every token id exactly, so one packed tensor keeps it to one transfer.
        values = torch.cat(
            [sampled.token_ids.double().unsqueeze(1), sampled.sampled_ranks.double().unsqueeze(1),
             sampled.logprob_token_ids.double(), sampled.logprobs.double()], dim=1,
        )  # fmt: skip
    prompt_values, plan = prompt if prompt is not None else (None, None)
    if not use_cuda:
        return HostTransfer(
            host=values, done=None, num_logprobs=num_logprobs, prompt=prompt_values, prompt_plan=plan
        )

    def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
        # Pinned memory from torch's caching host allocator: the copy is truly asynchronous, and the
        # block is not reused until the copy that wrote it has completed.
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    host, prompt_host = to_host(values), to_host(prompt_values)
    done = torch.cuda.Event()
    done.record()
    return HostTransfer(host=host, done=done, num_logprobs=num_logprobs, prompt=prompt_host, prompt_plan=plan)


@dataclass
class PendingOutput:
    """A queued step's output: `resolve()` waits for its sampled ids (rank 0) and builds the reply."""

    step_id: int
    req_ids: list[int]
    transfer: HostTransfer | None
    num_sampled: int
    timings: dict[str, float] | None = None  # None: timings are off
    # (previous step's forward end, this forward's start, its end): CUDA events or wall times.
    device_marks: tuple[Any, Any, Any] | None = None

    def ready(self) -> bool:
        """True when resolve() would not wait for the device."""
        return self.transfer is None or self.transfer.ready()

    def resolve(self) -> ModelRunnerOutput:
        """With async scheduling rank 0 calls it once the next step is queued (or none will come)."""
        t0 = time.perf_counter()
        ready_before_asked = self.ready()
        prompt_logprobs = None
        if self.transfer is None:
            if self.num_sampled:
                raise RuntimeError("internal: only rank 0 (or sync_first) copies sampled ids to the host")
            token_ids: list[int] = []
            logprobs = None
        else:
            token_ids, logprobs = self.transfer.values()
            prompt_logprobs = self.transfer.prompt_logprobs()
        timings = self.timings
        if timings is not None:
            timings.setdefault("sync_wait", time.perf_counter() - t0)
            self._device_timings(timings)
        return ModelRunnerOutput(
            step_id=self.step_id,
            req_ids=self.req_ids,
            sampled_token_ids=token_ids,
            logprobs=logprobs,
            timings=timings,
            prompt_logprobs=prompt_logprobs,
            ready_before_asked=ready_before_asked,
        )

    def _device_timings(self, timings: dict[str, float]) -> None:
        if self.device_marks is None:
            return
        prev_end, start, end = self.device_marks
        if isinstance(start, float):
            # On CPU the forward ran synchronously between the two marks.
            timings["forward_device"] = end - start
            if isinstance(prev_end, float):
                timings["host_gap"] = start - prev_end
            return
        end.synchronize()
        timings["forward_device"] = start.elapsed_time(end) / 1e3
        if prev_end is not None:
            timings["host_gap"] = prev_end.elapsed_time(start) / 1e3
