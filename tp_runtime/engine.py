"""The driver: LLMEngine (step loop, tokenizer, stop checks) and LLM, the offline batch API."""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tp_runtime.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    build_model_config,
    resolve_device,
)
from tp_runtime.errors import ConfigError, InvalidRequestError
from tp_runtime.executor import (
    Executor,
    InProcessExecutor,
    MultiprocExecutor,
    executor_kind,
    start_torchrun_rank,
)
from tp_runtime.messages import ModelRunnerOutput, RequestSampling, SchedulerOutput
from tp_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from tp_runtime.sampling_params import SamplingParams
from tp_runtime.scheduler import Request, Scheduler

PromptType = str | dict[str, Any]


@dataclass
class _StopState:
    """Incremental detokenization, kept only for requests with stop strings."""

    stream: Any
    text: str = ""
    stop_strings: list[str] = field(default_factory=list)


def make_executor(config: EngineConfig) -> Executor:
    kind = executor_kind(config)
    if kind == "inprocess":
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError("executor='inprocess' only runs tensor_parallel_size=1")
        return InProcessExecutor(config)
    if kind == "multiprocess":
        return MultiprocExecutor(config)
    executor = start_torchrun_rank(config)
    if executor is None:
        # A torchrun rank > 0 has served as a worker until the driver shut down; nothing else to do.
        raise SystemExit(0)
    return executor


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.executor = make_executor(config)
        self.num_kv_blocks = self.executor.initialize()
        max_blocks = -(-config.model.max_model_len // config.cache.block_size)
        if self.num_kv_blocks < max_blocks:
            self.executor.shutdown()
            raise ConfigError(
                f"the KV cache holds {self.num_kv_blocks} blocks of {config.cache.block_size} tokens but one "
                f"sequence of max_model_len={config.model.max_model_len} needs {max_blocks}; lower "
                "max_model_len or give the cache more memory"
            )
        self.scheduler = Scheduler(config, self.num_kv_blocks)
        self.eos_token_ids = set(config.model.eos_token_ids)
        self._next_req_id = 0
        self._stop_states: dict[int, _StopState] = {}
        # Per-step timings (seconds) of the driver's own phases, when enabled (benchmarks).
        self.step_timings: list[dict[str, float]] | None = None
        self.async_scheduling = config.async_scheduling
        # Async scheduling: the step sent last, whose output is read in the next step() call.
        self._in_flight: SchedulerOutput | None = None
        # Timings: when the interval that produces the next output began (the last output's arrival).
        self._interval_start: float | None = None

    # ----------------------------------------------------------------- requests
    def _validate_prompt(self, prompt_ids: Any) -> list[int]:
        vocab = self.config.model.vocab_size
        if not isinstance(prompt_ids, (list, tuple)):
            raise InvalidRequestError(
                f"prompt_token_ids must be a list of ints, got {type(prompt_ids).__name__}"
            )
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        for t in prompt_ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"prompt token ids must be ints, got {t!r}")
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt token id {t} is outside the vocabulary [0, {vocab})")
        max_len = self.config.model.max_model_len
        if len(prompt_ids) >= max_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}; shorten the prompt "
                "or raise max_model_len (a prompt must leave room for at least one generated token)"
            )
        return list(prompt_ids)

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> int:
        prompt_ids = self._validate_prompt(prompt_ids)
        self.validate_params(params)
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        sampling = RequestSampling(
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=max(int(params.top_k), 0),
            min_p=float(params.min_p),
            seed=params.seed,
            min_tokens=params.min_tokens,
            stop_token_ids=sorted(stop_ids) if params.min_tokens else [],
            num_logprobs=-1 if params.logprobs is None else int(params.logprobs),
        )
        req_id = self._next_req_id
        self._next_req_id += 1
        request = Request(req_id, prompt_ids, params, sampling)
        request.stop_ids = frozenset(stop_ids)
        self.scheduler.add(request)
        if params.stop_strings:
            self._stop_states[req_id] = _StopState(self._decode_stream(), stop_strings=params.stop_strings)
        return req_id

    def validate_params(self, params: Any) -> None:
        """Checks of SamplingParams that need the model (its own fields are checked on construction)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
        vocab = self.config.model.vocab_size
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequestError(f"logprobs={params.logprobs} exceeds the vocabulary size {vocab}")
        for t in params.stop_token_ids or []:
            if t >= vocab:
                raise InvalidRequestError(f"stop token id {t} is outside the vocabulary [0, {vocab})")

    def _decode_stream(self) -> Any:
        """tokenizers' incremental decoder (handles bytes split across tokens), for fast tokenizers."""
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=True)

    # ----------------------------------------------------------------- stepping
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it.

        With async scheduling the step sent here is only queued: this call then reads the output of the
        step sent by the previous call, so the workers already hold their next step while the driver
        handles this output. Without it, the step's own output is awaited."""
        t0 = time.perf_counter()
        if self._interval_start is None:
            self._interval_start = t0
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        if so.scheduled_req_ids or not self.async_scheduling:
            self.executor.submit(so)
            sent: SchedulerOutput | None = so
        else:
            sent = None  # nothing can run before the in-flight step's tokens are in
            self.scheduler.return_freed(so.freed_req_ids)
        t2 = time.perf_counter()
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, sent
        else:
            done = sent
        if done is None:
            return []
        output = self.executor.wait_output(done.step_id)
        t3 = time.perf_counter()
        finished = []
        for req in self.scheduler.update(output):
            reason = self._check_stop(req)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self._stop_states.pop(req.req_id, None)
                finished.append(req)
        t4 = time.perf_counter()
        if self.step_timings is not None:
            self._record_timings(done, output, t0, t1, t2, t3, t4, self._interval_start, sent is None)
        self._interval_start = t4 if self.scheduler.has_unfinished else None
        return finished

    def _record_timings(
        self,
        so: SchedulerOutput,
        output: ModelRunnerOutput,
        t0: float,
        t1: float,
        t2: float,
        t3: float,
        t4: float,
        interval_start: float,
        drain: bool,
    ) -> None:
        """`so` is the step whose output was read; with async scheduling the phases before the wait
        belong to the next step, which is how the driver's work overlaps the device's. step_total is the
        time since the previous output was handled (or since the first step began), so step totals add up
        to the wall time in either mode."""
        assert self.step_timings is not None
        entry = {
            "schedule": t1 - t0,
            "wait_output": t3 - t2,
            "execute_roundtrip": t3 - t1,
            "engine_update": t4 - t3,
            "step_total": t4 - interval_start,
        }
        entry["num_scheduled_tokens"] = float(sum(so.num_scheduled_tokens))
        entry["decode_only"] = float(all(n == 1 for n in so.num_scheduled_tokens))
        entry["async_scheduling"] = float(self.async_scheduling)
        # Async scheduling's last call of a batch sends nothing and only reads the last output: not a step.
        entry["drain"] = float(drain and self.async_scheduling)
        if not drain:
            entry.update(self.executor.last_step_timings)  # a drain step sent nothing
        if output.timings:
            entry.update({f"worker_{k}": v for k, v in output.timings.items()})
            entry["overhead"] = entry["step_total"] - output.timings.get("forward_device", 0.0)
        self.step_timings.append(entry)

    def _check_stop(self, req: Request) -> str | None:
        params = req.params
        token = req.output_token_ids[-1]
        num_out = len(req.output_token_ids)
        num_known = len(req.prompt_token_ids) + num_out
        if token in req.stop_ids and num_out >= params.min_tokens:
            if params.stop_token_ids and token in params.stop_token_ids:
                req.stop_reason = token
            return "stop"
        state = self._stop_states.get(req.req_id)
        if state is not None:
            if state.stream is not None:
                chunk = state.stream.step(self.tokenizer.backend_tokenizer, token)
            else:  # a tokenizer without a Rust backend: decode the whole output again
                text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
                chunk = text[len(state.text) :] if text.startswith(state.text) else None
            if chunk:
                start = max(0, len(state.text) - max(len(s) for s in state.stop_strings) + 1)
                state.text += chunk
                if num_out >= params.min_tokens:
                    for stop in state.stop_strings:
                        idx = state.text.find(stop, start)
                        if idx >= 0:
                            req.stop_reason = stop
                            req.stop_text = state.text[:idx]
                            return "stop"
        if num_out >= params.max_tokens or num_known >= self.config.model.max_model_len:
            return "length"
        return None

    def abort_all(self) -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, "abort")
        self._stop_states.clear()

    def shutdown(self) -> None:
        self.executor.shutdown()


def _decode_logprobs(tokenizer: Any, req: Request) -> list[dict[int, Logprob]]:
    out = []
    for token_ids, logprobs, sampled_rank in req.logprobs:
        entry: dict[int, Logprob] = {}
        for pos, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            if tid in entry:
                continue
            rank = sampled_rank if pos == 0 else pos
            entry[tid] = Logprob(logprob=lp, rank=rank, decoded_token=tokenizer.decode([tid]))
        out.append(entry)
    return out


class LLM:
    """Offline batch inference: `LLM(model=PATH, tensor_parallel_size=N).generate(prompts, params)`."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        load_format: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        step_timeout_s: float = 300.0,
        executor: str = "auto",
        all_reduce: str = "auto",
        async_scheduling: bool = True,
        enforce_eager: bool = False,
        cuda_graphs: str = "auto",
        attention_backend: str = "auto",
        fused_kernels: str = "auto",
    ) -> None:
        resolved_device = resolve_device(device)
        model_config = build_model_config(
            model, dtype=dtype, device=resolved_device, max_model_len=max_model_len, load_format=load_format
        )
        config = EngineConfig(
            model=model_config,
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size, executor=executor, step_timeout_s=step_timeout_s,
                driver_host=os.environ.get("MASTER_ADDR", "127.0.0.1"), all_reduce=all_reduce,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
            device=resolved_device,
            seed=seed,
            async_scheduling=async_scheduling,
            cuda_graphs="off" if enforce_eager else cuda_graphs,
            attention_backend=attention_backend,
            fused_kernels=fused_kernels,
        )  # fmt: skip
        self._start(config)

    def _start(self, config: EngineConfig) -> None:
        import transformers

        self.config = config
        model = config.model.path
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
        except Exception as exc:
            raise ConfigError(f"could not load a tokenizer from {model}: {exc}") from exc
        self.engine = LLMEngine(self.config, self.tokenizer)
        self._closed = False
        # Shut the workers down at interpreter exit even if the user never calls shutdown().
        self._atexit = weakref.WeakMethod(self.shutdown)
        atexit.register(_shutdown_at_exit, self._atexit)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            self.engine.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one character or token")
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        raise InvalidRequestError(
            f"a prompt must be a str or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("this LLM has been shut down; create a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"a prompt must be a str or a dict with 'prompt_token_ids' (or a list of them), "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (SamplingParams, list, tuple)):
            raise InvalidRequestError(
                "sampling_params must be a SamplingParams or a list of them, "
                f"got {type(sampling_params).__name__}"
            )
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise InvalidRequestError(
                f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                "give one, or one per prompt"
            )
        # Tokenize and validate everything before the first request enters the engine.
        for params in params_list:
            self.engine.validate_params(params)
        encoded = [self._prompt_ids(p) for p in prompts]
        for _, ids in encoded:
            self.engine._validate_prompt(ids)
        owners: dict[int, tuple[int, int]] = {}  # engine req id -> (prompt index, sample index)
        try:
            for i, ((_, ids), params) in enumerate(zip(encoded, params_list, strict=True)):
                for j in range(params.n):
                    child = (
                        params
                        if params.n == 1 or params.seed is None
                        else _with_seed(params, params.seed + j)
                    )
                    owners[self.engine.add_request(ids, child)] = (i, j)
            finished = self._run(len(owners), use_tqdm)
        except BaseException:
            self.engine.abort_all()
            raise
        results = [
            RequestOutput(request_id=str(i), prompt=text, prompt_token_ids=list(ids), outputs=[])
            for i, (text, ids) in enumerate(encoded)
        ]
        for req in sorted(finished, key=lambda r: owners[r.req_id]):
            i, j = owners[req.req_id]
            results[i].outputs.append(self._completion(req, j))
        return results

    def _run(self, total: int, use_tqdm: bool) -> list[Request]:
        from tqdm.auto import tqdm

        finished: list[Request] = []
        with tqdm(total=total, desc="generate", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                done = self.engine.step()
                finished.extend(done)
                bar.update(len(done))
        return finished

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        text = req.stop_text
        if text is None:
            text = str(self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True))
        logprobs = None
        cumulative = None
        if req.params.logprobs is not None:
            logprobs = _decode_logprobs(self.tokenizer, req)
            cumulative = sum(lp[1][0] for lp in req.logprobs)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
        )


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed, n=1)


def _shutdown_at_exit(ref: weakref.WeakMethod[Any]) -> None:
    method = ref()
    if method is not None:
        method()
