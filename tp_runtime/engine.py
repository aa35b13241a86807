"""The driver: LLMEngine (step loop, tokenizer, stop checks) and LLM, the offline batch API."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
from tp_runtime.models_catalog import resolve_model_name
from tp_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from tp_runtime.sampling_params import SamplingParams
from tp_runtime.scheduler import Request, Scheduler

PromptType = str | dict[str, Any]
ChatMessage = dict[str, Any]


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
                "max_model_len or give the cache more memory (gpu_memory_utilization, cpu_kv_cache_gib)"
            )
        self.scheduler = Scheduler(config, self.num_kv_blocks)
        self.eos_token_ids = set(config.model.eos_token_ids)
        self._next_req_id = 0
        self._stop_states: dict[int, _StopState] = {}
        self.num_output_tokens = 0  # generated so far, over the engine's life (progress bars read it)
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
        vocab = self.config.model.vocab_size
        sampling = RequestSampling(
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            # top_k at or above the vocabulary size keeps every token: capped to what workers hold.
            top_k=min(max(int(params.top_k), 0), vocab),
            min_p=float(params.min_p),
            seed=params.seed,
            # No request outlives max_model_len, so a larger min_tokens means the same (and fits int64).
            min_tokens=min(params.min_tokens, self.config.model.max_model_len),
            stop_token_ids=sorted(stop_ids) if params.min_tokens else [],
            num_logprobs=-1 if params.logprobs is None else int(params.logprobs),
            repetition_penalty=float(params.repetition_penalty),
            presence_penalty=float(params.presence_penalty),
            frequency_penalty=float(params.frequency_penalty),
            num_prompt_logprobs=-1 if params.prompt_logprobs is None else int(params.prompt_logprobs),
        )
        req_id = self._next_req_id
        self._next_req_id += 1
        request = Request(req_id, prompt_ids, params, sampling)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * (len(prompt_ids) - 1)
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
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > min(vocab, limit):
                raise InvalidRequestError(
                    f"{name}={value} exceeds "
                    + (f"the vocabulary size {vocab}" if value > vocab else f"max_logprobs={limit}")
                    + "; ask for fewer (or raise LLM(max_logprobs=...))"
                )
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
        updated = self.scheduler.update(output)
        self.num_output_tokens += len(updated)
        for req in updated:
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
                            if params.include_stop_str_in_output:
                                idx += len(stop)
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


def _decode_logprobs(tokenizer: Any, entry: tuple[list[int], list[float], int]) -> dict[int, Logprob]:
    """One position: the chosen (sampled or prompt) token first, then the top-k by rank."""
    token_ids, logprobs, chosen_rank = entry
    out: dict[int, Logprob] = {}
    for pos, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        if tid not in out:
            rank = chosen_rank if pos == 0 else pos
            out[tid] = Logprob(logprob=lp, rank=rank, decoded_token=tokenizer.decode([tid]))
    return out


class LLM:
    """Offline batch inference: `LLM(model=PATH, tensor_parallel_size=N).generate(prompts, params)`.

    Thread safety: `generate` and `chat` may be called from several threads at once; the calls are
    serialized (a lock held for the whole call, tokenization included), so each caller gets exactly the
    outputs it would get alone while the engine's step loop stays single-threaded. A second caller waits
    for the first to finish. `shutdown()` does not wait: calling it while another thread generates ends
    that call with an error.
    """

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
        cpu_kv_cache_gib: float | None = None,
        step_timeout_s: float = 300.0,
        executor: str = "auto",
        all_reduce: str = "auto",
        async_scheduling: bool = True,
        enforce_eager: bool = False,
        cuda_graphs: str = "auto",
        attention_backend: str = "auto",
        fused_kernels: str = "auto",
        max_logprobs: int = 20,
    ) -> None:
        model = resolve_model_name(model, load_format)
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
                cpu_kv_cache_gib=cpu_kv_cache_gib,
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
            max_logprobs=max_logprobs,
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
        self._lock = threading.RLock()  # serializes generate/chat callers (see the class doc)
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

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine encodes prompts and decodes outputs with."""
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"the prompt {_preview(text)} cannot be tokenized: {exc.object[exc.start : exc.end]!r} at "
                f"index {exc.start} is not valid Unicode text (a lone surrogate); remove or replace it"
            ) from None
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as exc:
            raise InvalidRequestError(
                f"the tokenizer cannot encode the prompt {_preview(text)}: {type(exc).__name__}: {exc}"
            ) from None

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one character or token")
            return prompt, self._encode(prompt)
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
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list of
        them, rendered with the tokenizer's chat template (or `chat_template`, a Jinja string) as vLLM's
        `LLM.chat` does; one RequestOutput per conversation, whose prompt is the rendered text."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
            conversations: list[Any] = [messages]
        elif isinstance(messages, (list, tuple)) and messages:
            conversations = list(messages)
        else:
            raise InvalidRequestError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} dicts, or a list of such "
                f"conversations, got {_preview(messages)}"
            )
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)) or not conv or not all(isinstance(m, dict) for m in conv):
                raise InvalidRequestError(
                    f"conversation {i} must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                    f"got {_preview(conv)}"
                )
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"the tokenizer of {self.config.model.path} has no chat template; pass chat_template= "
                "(a Jinja template string) to LLM.chat"
            )
        with self._lock:  # the tokenizer is not safe to share between threads either
            prompts: list[PromptType] = []
            for conv in conversations:
                try:
                    text = self.tokenizer.apply_chat_template(
                        list(conv), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, tokenize=False,
                    )  # fmt: skip
                except Exception as exc:
                    raise InvalidRequestError(
                        f"the chat template failed on conversation {_preview(conv)}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from None
                # The template writes the special tokens (BOS...) itself, as HF's apply_chat_template does.
                ids = self._encode(str(text), add_special_tokens=False)
                prompts.append({"prompt": text, "prompt_token_ids": ids})
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
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
                    child = params if params.n == 1 else _child_params(params, j)
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
            if req.prompt_logprobs is not None:
                results[i].prompt_logprobs = [
                    None,
                    *(e and _decode_logprobs(self.tokenizer, e) for e in req.prompt_logprobs),
                ]
        return results

    def _run(self, total: int, use_tqdm: bool) -> list[Request]:
        if not use_tqdm:
            finished: list[Request] = []
            while self.engine.has_unfinished_requests():
                finished.extend(self.engine.step())
            return finished
        from tqdm.auto import tqdm

        finished = []
        engine = self.engine
        start, tokens_before = time.perf_counter(), engine.num_output_tokens
        shown = start
        with tqdm(total=total, desc="generate", dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                done = engine.step()
                finished.extend(done)
                now = time.perf_counter()
                if done or now - shown > 0.5:  # the rate, at most twice a second between completions
                    shown = now
                    rate = (engine.num_output_tokens - tokens_before) / max(now - start, 1e-9)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                bar.update(len(done))
        return finished

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        text = req.stop_text
        if text is None:
            ids = req.output_token_ids
            if req.finish_reason == "stop" and not req.params.include_stop_str_in_output:
                ids = ids[:-1]  # a stop token (EOS or stop_token_ids): its text is left out, as vLLM does
            text = str(self.tokenizer.decode(ids, skip_special_tokens=True))
        logprobs = None
        cumulative = None
        if req.params.logprobs is not None:
            logprobs = [_decode_logprobs(self.tokenizer, e) for e in req.logprobs]
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


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 request: seed + index (as vLLM), wrapped into the int64 range so that
    any seed the user may pass works; prompt logprobs come from the first sample only."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index + 2**63) % 2**64 - 2**63
    return replace(params, seed=seed, n=1, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def _preview(value: Any, limit: int = 80) -> str:
    """repr of what the user passed, shortened for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shutdown_at_exit(ref: weakref.WeakMethod[Any]) -> None:
    method = ref()
    if method is not None:
        method()
