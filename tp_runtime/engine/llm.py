"""LLM: the offline batch API (generate, chat) on top of LLMEngine."""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tp_runtime.config import EngineConfig, load_tokenizer
from tp_runtime.engine.args import EngineArgs
from tp_runtime.engine.llm_engine import LLMEngine, best_samples, check_cache_salt, child_params
from tp_runtime.errors import ConfigError, EngineClosedError, InvalidRequestError
from tp_runtime.inputs import PromptType
from tp_runtime.outputs import RequestOutput
from tp_runtime.sampling_params import SamplingParams, truncated_prompt
from tp_runtime.server.tool_calls import template_tool_call

ChatMessage = dict[str, Any]


# apply_chat_template's own arguments, which chat_template_kwargs may not override.
_TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "chat_template", "add_generation_prompt", "continue_final_message",
     "tokenize", "return_dict", "tools", "documents"}
)  # fmt: skip


def template_variables(chat_template_kwargs: Any) -> dict[str, Any]:
    """Extra variables for the chat template (e.g. Qwen3's enable_thinking), checked."""
    if chat_template_kwargs is None:
        return {}
    given = chat_template_kwargs
    if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
        got = _preview(given)
        raise InvalidRequestError(f"chat_template_kwargs must be a dict of template variables, got {got}")
    reserved = sorted(_TEMPLATE_ARGUMENTS & given.keys())
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: those are arguments of their own"
        )
    return dict(given)


def _refuse_unsupported(lora_request: Any, priority: Any) -> None:
    """vLLM's per-request options this engine lacks, taken only at the values that ask for nothing."""
    if lora_request is not None:
        raise InvalidRequestError("LoRA adapters are not supported: pass lora_request=None")
    if priority is not None and (
        not isinstance(priority, (list, tuple)) or any(p != 0 or isinstance(p, bool) for p in priority)
    ):
        raise InvalidRequestError(
            f"priority scheduling is not supported: pass priority=None (or all 0), got {_preview(priority)}"
        )


@functools.lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether a chat template walks a message's content as a list of parts (`{% for part in
    message['content'] %}`, maybe through a filter): vLLM's "auto" content format then gives it the parts
    ("openai"), a string content as one text part, where other templates get the text ("string")."""
    import jinja2
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # transformers' own environment: its extensions ({% generation %}, loop controls) parse
        tree = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError:
        return False

    def under(node: nodes.Node) -> nodes.Node:  # through filters, tests and slices
        while True:
            inner = node.node if isinstance(node, (nodes.Filter, nodes.Test, nodes.Getitem)) else None
            if inner is None or (isinstance(node, nodes.Getitem) and not isinstance(node.arg, nodes.Slice)):
                return node
            node = inner

    def named(node: nodes.Node, names: set[str]) -> bool:
        node = under(node)
        return isinstance(node, nodes.Name) and node.name in names

    # As vLLM scopes it: the loop variables of loops over the messages (or a name set to them), whose
    # `content` a loop then walks; a loop over some other value's content is not the messages' format.
    lists = {"messages"}
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and named(assign.node, lists):
            lists.add(assign.target.name)
    messages = {
        loop.target.name for loop in tree.find_all(nodes.For)
        if isinstance(loop.target, nodes.Name) and named(loop.iter, lists)
    }  # fmt: skip

    def content_of(node: nodes.Node) -> bool:
        node = under(node)
        if isinstance(node, nodes.Getattr):
            return node.attr == "content" and named(node.node, messages)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            return bool(node.arg.value == "content") and named(node.node, messages)
        return False

    return any(content_of(loop.iter) for loop in tree.find_all(nodes.For))


# Content parts that are text, and the key that holds it (vLLM's parts read as text; OpenAI's Responses
# style input_text / output_text, and an assistant's refusal).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def chat_content_parts(content: Any, index: int) -> list[dict[str, str]]:
    """A chat message's content as the parts a template that loops over them gets (loops_over_content):
    its text parts, a string as one text part, None as none (vLLM's "openai" content format)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": text} for text in _part_texts(content, index)]


def chat_content_text(content: Any, index: int) -> str:
    """A chat message's content as the text the template gets: a string (None: empty), or OpenAI-style
    content parts of which only text ones are supported (`_TEXT_PARTS`), one per line (as vLLM joins
    them)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_part_texts(content, index))


def _part_texts(content: Any, index: int) -> list[str]:
    if not isinstance(content, (list, tuple)):
        raise InvalidRequestError(
            f"message {index}: content must be a string or a list of content parts, got {_preview(content)}"
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = _TEXT_PARTS.get(kind) if isinstance(part, dict) and isinstance(kind, str) else None
        if key is None:
            raise InvalidRequestError(
                f"message {index}: only text content parts ({{'type': 'text', 'text': ...}}) are supported, "
                f"got {kind!r}"
            )
        if not isinstance(part.get(key), str):
            # A text part without its text: say so (the message above would call it no text part).
            raise InvalidRequestError(
                f"message {index}: a {kind} content part needs its {key} as a string, "
                f"got {_preview(part.get(key))}"
            )
        texts.append(part[key])
    return texts


def _template_message(message: ChatMessage, index: int, parts: bool) -> ChatMessage:
    """A message as the chat template gets it, as the server and vLLM give it: content parts become their
    text and no content (None or absent, e.g. an assistant turn that only called tools) empty text, or with
    `parts` (a template that loops over them) a list of text parts; earlier tool calls' arguments
    (OpenAI's JSON text) become objects, as tool-use templates read them."""
    content = message.get("content")
    text = chat_content_parts(content, index) if parts else chat_content_text(content, index)
    out = {**message, "content": text}
    calls = message.get("tool_calls")
    if isinstance(calls, (list, tuple)):
        try:
            out["tool_calls"] = [template_tool_call(call) for call in calls]
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"message {index}: {exc}") from None
    return out


class LLM:
    """Offline batch inference: `LLM(model=PATH, tensor_parallel_size=N).generate(prompts, params)`.

    Thread safety: `generate` and `chat` may be called from several threads at once; the calls are
    serialized (a lock held for the whole call, tokenization included), so each caller gets exactly the
    outputs it would get alone while the engine's step loop stays single-threaded. A second caller waits
    for the first to finish. `shutdown()` does not wait for that call: calling it while another thread
    generates ends the call with EngineClosedError (after the step in progress, at TP 1).
    """

    def __init__(self, model: str | os.PathLike[str], **options: Any) -> None:
        """`model`: a checkpoint folder or a built-in model name; `options`: any field of
        `tp_runtime.EngineArgs` (tensor_parallel_size, dtype, max_model_len, ...), where each option's
        type, default and meaning are declared."""
        self._start(_engine_args(model, options).create_engine_config())

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(**args.to_llm_kwargs())

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_source, config.trust_remote_code)
        self.engine = LLMEngine(self.config, self.tokenizer)
        self._lock = threading.RLock()  # serializes generate/chat callers (see the class doc)
        self._closed = False
        self._request_ids = itertools.count()  # RequestOutput.request_id: unique over this LLM's life
        # Shut the workers down at interpreter exit even if the user never calls shutdown().
        # A process forked from this one inherits this object, its exit hook and its finalizer: the
        # engine and its socket folder are not the child's to shut down (see shutdown).
        self._owner_pid = os.getpid()
        # This engine's own hook (atexit.unregister removes a callable's every registration).
        self._exit_hook = functools.partial(_shutdown_at_exit, weakref.WeakMethod(self.shutdown))
        atexit.register(self._exit_hook)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers and free the engine; a no-op when already shut down, and in a process forked
        from this one (the engine is its parent's)."""
        if not getattr(self, "_closed", True) and os.getpid() == self._owner_pid:
            self._closed = True
            atexit.unregister(self._exit_hook)  # a program that makes many engines keeps no hook of each
            self.engine.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (as vLLM's): later requests compute theirs anew. Between
        `generate` calls nothing is running, so it always does (True); from another thread it waits for
        the running call (the scheduler's blocks are the engine thread's)."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def get_tokenizer(self, lora_request: Any = None) -> Any:
        """The Hugging Face tokenizer the engine encodes prompts and decodes outputs with."""
        _refuse_unsupported(lora_request, None)
        return self.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for it): `self.engine`."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams, as vLLM's: SamplingParams
        with the model's generation config's defaults (repetition_penalty, temperature, top_k, top_p, min_p,
        max_new_tokens as max_tokens) where it sets them (LLM(generation_config=...) says which config;
        "vllm": none), SamplingParams' own defaults for the rest."""
        return SamplingParams(**self.config.model.generation_defaults.overrides())

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

    def _prompt_ids(self, prompt: Any) -> tuple[str | None, list[int]]:  # (checked here: any value)
        if isinstance(prompt, str):
            ids = self._encode(prompt)
            if not ids:  # "" is a prompt where the tokenizer puts a BOS in front, as in vLLM
                raise InvalidRequestError("the prompt is empty; give at least one character or token")
            return prompt, ids
        if isinstance(prompt, dict) and (unserved := sorted(map(str, prompt.keys() - _PROMPT_KEYS))):
            # vLLM's multi_modal_data and the like: refused, rather than generating as if they were not there.
            raise InvalidRequestError(
                f"a prompt dict takes only 'prompt', 'prompt_token_ids' and 'cache_salt' here, got "
                f"{unserved} (this engine serves text-only models)"
            )
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestError(
                    "a token-id prompt's 'prompt' (its text, kept for the output) must be a str or None, "
                    f"got {type(text).__name__}"
                )
            return text, prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt
            return self._prompt_ids(prompt["prompt"])
        got = type(prompt).__name__
        if isinstance(prompt, dict):
            got = f"a dict with keys {sorted(map(str, prompt))}"
        raise InvalidRequestError(
            "a prompt must be a str or a dict with 'prompt_token_ids' (a list of ints) or 'prompt' (a str), "
            f"got {got}"
        )

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt. `sampling_params`: one for every prompt or one per prompt; None:
        `get_default_sampling_params()` (the model's generation config's defaults, as in vLLM). `use_tqdm`:
        a progress bar, or, as in vLLM, the callable that makes it (tqdm's keyword arguments; e.g.
        `functools.partial(tqdm, leave=False)`). `lora_request` and `priority` are vLLM's, taken as
        code written for it passes them: None (and priorities all 0); anything else is refused."""
        _refuse_unsupported(lora_request, priority)
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        lora_request: Any = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a list of
        them, rendered with the tokenizer's chat template (or `chat_template`, a Jinja string) as vLLM's
        `LLM.chat` does; one RequestOutput per conversation, whose prompt is the rendered text.
        `chat_template_kwargs`: extra template variables (e.g. Qwen3's enable_thinking); `tools`: the
        functions ({"type": "function", "function": {...}}) the template shows the model, as vLLM's;
        `documents`: the retrieved documents ({"title": ..., "text": ...}) a RAG template shows it.
        `sampling_params` as `generate`'s (None: `get_default_sampling_params()`). vLLM's
        `chat_template_content_format` ("auto", "string" or "openai") is taken and changes nothing: text
        content parts are joined into the text the template sees either way; `lora_request` and
        `mm_processor_kwargs` are taken as None only."""
        _refuse_unsupported(lora_request, None)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError(
                'chat_template_content_format must be "auto", "string" or "openai", got '
                f"{_preview(chat_template_content_format)}"
            )
        if mm_processor_kwargs is not None:
            raise InvalidRequestError("mm_processor_kwargs: this engine serves text-only models; pass None")
        variables = template_variables(chat_template_kwargs)
        for name, given in (("tools", tools), ("documents", documents)):
            dicts = isinstance(given, (list, tuple)) and all(isinstance(t, dict) for t in given)
            if given is not None and not dicts:
                kind = "tool dicts" if name == "tools" else "dicts"
                raise InvalidRequestError(f"{name} must be a list of {kind}, got {_preview(given)}")
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
        if chat_template is not None and not isinstance(chat_template, str):
            raise InvalidRequestError(
                f"chat_template must be a Jinja template string (or None), got {_preview(chat_template)}"
            )
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                f"the tokenizer of {self.config.tokenizer_source} has no chat template; pass chat_template= "
                "(a Jinja template string) to LLM.chat"
            )
        try:
            template = self.tokenizer.get_chat_template(chat_template, tools and list(tools))
        except Exception as exc:  # a tokenizer's named templates without a default, say
            raise InvalidRequestError(f"the chat template: {type(exc).__name__}: {exc}") from None
        parts = loops_over_content(template)
        conversations = [[_template_message(m, j, parts) for j, m in enumerate(c)] for c in conversations]
        with self._lock:  # the tokenizer is not safe to share between threads either
            prompts: list[PromptType] = []
            for conv in conversations:
                try:
                    text = self.tokenizer.apply_chat_template(
                        list(conv), chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, tokenize=False,
                        tools=None if tools is None else list(tools),
                        documents=None if documents is None else list(documents), **variables,
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
        use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        if self._closed:  # the error a call to an engine that died raises too
            raise EngineClosedError("this LLM has been shut down; create a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"a prompt must be a str or a dict with 'prompt_token_ids' (or a list of them), "
                f"got {type(prompts).__name__}"
            )
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
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
        # Tokenize and validate everything before the first request enters the engine; in a batch the
        # error says which prompt (or its SamplingParams) it is about.
        shared = isinstance(sampling_params, SamplingParams)
        if shared:
            self.engine.validate_params(sampling_params)  # about no one prompt
        encoded: list[tuple[str | None, list[int]]] = []
        salts: list[str | None] = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                if not shared:
                    self.engine.validate_params(params)
                text, ids = self._prompt_ids(prompt)
                salts.append(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
                check_cache_salt(salts[-1])
                max_len = self.engine.config.model.max_model_len
                ids = truncated_prompt(ids, params.truncate_prompt_tokens, max_len)
                encoded.append((text, self.engine._validate_prompt(ids)))
            except InvalidRequestError as exc:
                if len(prompts) == 1:
                    raise
                raise InvalidRequestError(f"prompt {i}: {exc}") from None
        owners: dict[str, tuple[int, int]] = {}  # engine request id -> (prompt index, sample index)
        try:
            for i, ((_, ids), params, salt) in enumerate(zip(encoded, params_list, salts, strict=True)):
                for j in range(params.samples):
                    req_id = self.engine.add_request(ids, child_params(params, j), cache_salt=salt)
                    owners[str(req_id)] = (i, j)
            finished = self._run(len(owners), use_tqdm)
        except BaseException:
            self.engine.abort_all()
            raise
        results = [
            RequestOutput(request_id=str(next(self._request_ids)), prompt=text, prompt_token_ids=list(ids),
                          outputs=[])
            for text, ids in encoded
        ]  # fmt: skip
        # Each engine request is one sample: its output goes into its prompt's, as sample j.
        for out in sorted(finished, key=lambda o: owners[o.request_id]):
            i, j = owners[out.request_id]
            completion = out.outputs[0]
            completion.index = j
            results[i].outputs.append(completion)
            if out.prompt_logprobs is not None:
                results[i].prompt_logprobs = out.prompt_logprobs
            if j == 0:  # the sample that computes the prompt: what the prompt found cached, its times
                results[i].num_cached_tokens = out.num_cached_tokens
                results[i].metrics = out.metrics
        for result, params in zip(results, params_list, strict=True):
            result.outputs = best_samples(params, result.outputs)
        return results

    def _run(self, total: int, use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        """Step until every request finished; returns their (whole) outputs."""
        if not use_tqdm:
            finished: list[RequestOutput] = []
            while self.engine.has_unfinished_requests():
                finished.extend(self.engine.step())
            return finished
        from tqdm.auto import tqdm

        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        finished = []
        engine = self.engine
        start, tokens_before = time.perf_counter(), engine.num_output_tokens
        shown = start
        with make_bar(total=total, desc="generate", dynamic_ncols=True) as bar:
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


# The keys of a prompt dict (vLLM's TextPrompt and TokensPrompt, text only).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})


def _preview(value: Any, limit: int = 80) -> str:
    """repr of what the user passed, shortened for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shutdown_at_exit(ref: weakref.WeakMethod[Any]) -> None:
    method = ref()
    if method is not None:
        method()


def run_torchrun_worker(model: str | os.PathLike[str], **options: Any) -> None:
    """Under torchrun, what every rank > 0 runs instead of `LLM(model, **options)`, with the same arguments:
    it serves rank 0's engine as a worker until rank 0 shuts it down. Rank 0 creates the LLM."""
    from tp_runtime.executor.torchrun import serve_worker_rank

    serve_worker_rank(_engine_args(model, options).create_engine_config())


def _engine_args(model: str | os.PathLike[str], options: dict[str, Any]) -> EngineArgs:
    unknown = sorted(set(options) - EngineArgs.option_names())
    if unknown:
        raise ConfigError(
            f"unknown engine option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(sorted(EngineArgs.option_names() - {'model'}))}"
        )
    return EngineArgs(model=model, **options)
