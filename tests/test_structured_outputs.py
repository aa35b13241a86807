"""Structured outputs (engine/structured_output.py): on the built-in random-weight model, whose text is
noise, only the constraint can make an output valid, so every sample is checked against its constraint
with an independent checker (json, re). Plus: unconstrained rows are untouched, TP 1 equals TP 2, async
scheduling equals sync, bad constraints are clear errors, and the workers refuse a malformed mask."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tp_runtime import LLM, SamplingParams, StructuredOutputsParams
from tp_runtime.errors import InvalidRequestError, ProtocolError
from tp_runtime.worker.model_runner import GrammarMasks

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def satisfies_schema(value: Any) -> bool:
    """SCHEMA, checked by hand."""
    if not isinstance(value, dict) or not {"name", "age", "pet"} <= value.keys() <= set(SCHEMA["properties"]):  # type: ignore[arg-type]
        return False
    tags = value.get("tags", [])
    return (
        isinstance(value["name"], str) and len(value["name"]) <= 6
        and type(value["age"]) is int and 0 <= value["age"] <= 150
        and value["pet"] in ("cat", "dog", "none")
        and isinstance(tags, list) and len(tags) <= 3 and all(type(t) is bool for t in tags)
    )  # fmt: skip


EBNF = 'root ::= "(" num (("+" | "*") num)* ")"\nnum ::= [1-9] [0-9]?'
EBNF_RE = r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)"
# The same language in Lark, which vLLM also takes (a grammar with no `::=` rule is read as Lark).
LARK = 'start: "(" num (("+" | "*") num)* ")"  // a comment\nnum: /[1-9][0-9]?/'



@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("tiny-llama-tp", device="cpu", max_model_len=512) as engine:
        yield engine


def _params(seed: int, max_tokens: int = 256, **constraint: Any) -> SamplingParams:
    spec = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(max_tokens=max_tokens, seed=seed, structured_outputs=spec)


def _texts(llm: LLM, params: list[SamplingParams], prompt: str = "Answer:") -> list[tuple[str, str | None]]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_every_sample_satisfies_its_constraint(llm: LLM) -> None:
    params = [_params(s, json=SCHEMA, disable_any_whitespace=s % 2 == 0) for s in range(6)]
    params += [_params(10 + s, 400, json_object=True, disable_any_whitespace=True) for s in range(3)]
    params += [_params(20 + s, regex=r"[a-f]{2,4}-\d{3}( ok)?") for s in range(3)]
    params += [_params(30 + s, choice=["red", "green", "blue sky"]) for s in range(4)]
    params += [_params(40 + s, grammar=EBNF) for s in range(3)]
    params += [_params(50 + s, grammar=LARK) for s in range(3)]
    results = _texts(llm, params)
    for (text, reason), p in zip(results, params, strict=True):
        spec = p.structured_outputs
        assert spec is not None
        if spec.json_object and reason == "length":
            # Any object: noise may stay inside a free string past max_tokens (then it is cut short).
            continue
        assert reason == "stop", (text, reason, spec)
        if spec.json is not None:
            assert satisfies_schema(json.loads(text, strict=False)), text  # (raw control characters: as vLLM)
        elif spec.json_object:
            assert isinstance(json.loads(text, strict=False), dict), text
        elif spec.regex is not None:
            assert re.fullmatch(spec.regex, text), text
        elif spec.choice is not None:
            assert text in spec.choice, text
        else:
            assert re.fullmatch(EBNF_RE, text), text
    # Seeded samples differ from one another (the constraint is not one fixed answer).
    assert len({text for text, _ in results[:6]}) > 1
    assert any(reason == "stop" for _, reason in results[6:9])


def test_unconstrained_rows_beside_constrained_ones_are_untouched(llm: LLM) -> None:
    free = [SamplingParams(max_tokens=24, seed=s, ignore_eos=True) for s in (1, 2)]
    alone = _texts(llm, free)
    mixed = _texts(llm, [free[0], _params(5, json=SCHEMA), free[1], _params(6, regex="[xyz]{5}")])
    assert [mixed[0], mixed[2]] == alone
    assert re.fullmatch("[xyz]{5}", mixed[3][0])


def test_seeded_outputs_equal_at_tp_1_and_2_and_with_or_without_async_scheduling(llm: LLM) -> None:
    params = [_params(s, json=SCHEMA) for s in range(3)]
    params += [_params(9, grammar=EBNF), _params(3, max_tokens=12)]
    want = _texts(llm, params)
    with LLM("tiny-llama-tp", device="cpu", max_model_len=512, tensor_parallel_size=2) as tp2:
        assert _texts(tp2, params) == want
    with LLM("tiny-llama-tp", device="cpu", max_model_len=512, async_scheduling=False) as sync:
        assert _texts(sync, params) == want


def test_async_scheduling_keeps_the_pipeline_under_a_constraint(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling a constrained step is sent before the previous step's output is read (its mask
    follows once that output has advanced the grammar), exactly as an unconstrained one: the device never
    waits for the driver's grammar work."""
    executor = llm.engine.executor
    calls: list[tuple[str, int, bool]] = []
    for name in ("submit", "wait_output", "submit_grammar_mask"):
        original = getattr(executor, name)

        def recorded(arg: Any, _name: str = name, _original: Any = original) -> Any:
            step = arg if isinstance(arg, int) else arg.step_id
            calls.append((_name, step, bool(getattr(arg, "grammar_mask_follows", False))))
            return _original(arg)

        monkeypatch.setattr(executor, name, recorded)
    [(text, reason)] = _texts(llm, [_params(4, json=SCHEMA)])
    assert reason == "stop" and satisfies_schema(json.loads(text, strict=False)), text
    submits = [(step, follows) for name, step, follows in calls if name == "submit"]
    sampled = [step for step, follows in submits if follows]
    assert len(sampled) >= 3  # a token of its own per step
    for step in sampled[1:]:
        # Step `step` is sent before step - 1's output is read, and its mask only after that.
        order = [c[:2] for c in calls]
        assert order.index(("submit", step)) < order.index(("wait_output", step - 1))
        assert order.index(("wait_output", step - 1)) < order.index(("submit_grammar_mask", step))


def test_an_error_while_a_mask_is_owed_leaves_the_engine_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step sent with its mask to follow, then a failure before the mask is made (here: reading the
    previous step's output): the ranks still get a mask, so the next generate runs."""
    with LLM("tiny-llama", device="cpu", max_model_len=128) as engine:
        executor = engine.engine.executor
        real, calls = executor.wait_output, []

        def failing(step_id: int) -> Any:
            calls.append(step_id)
            if len(calls) == 3:
                raise RuntimeError("injected")
            return real(step_id)

        monkeypatch.setattr(executor, "wait_output", failing)
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate(["hi"], _params(1, 20, regex="[ab]{10}"), use_tqdm=False)
        monkeypatch.setattr(executor, "wait_output", real)
        [out] = engine.generate(["hi"], _params(2, regex="[ab]{3}"), use_tqdm=False)
        assert re.fullmatch("[ab]{3}", out.outputs[0].text)


def test_a_mask_out_of_turn_is_a_protocol_error() -> None:
    from tp_runtime.messages import GrammarMask

    with LLM("tiny-llama", device="cpu", max_model_len=128) as engine:
        worker = engine.engine.executor.worker  # type: ignore[attr-defined]
        with pytest.raises(ProtocolError, match="a grammar mask for step 5 arrived while no step waits"):
            worker.apply_grammar_mask(GrammarMask(5, b""))
        # The engine serves on.
        [out] = engine.generate(["hi"], _params(1, regex="[ab]{3}"), use_tqdm=False)
        assert re.fullmatch("[ab]{3}", out.outputs[0].text)


def test_greedy_and_n_samples_under_a_constraint(llm: LLM) -> None:
    """Greedy and n > 1 (each sample its own matcher) keep to the constraint; the logprobs returned are
    the raw model's, as for unconstrained requests."""
    choices = ["alpha", "beta", "gamma"]
    spec = StructuredOutputsParams(choice=choices)
    greedy = llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=8, logprobs=2,
                          structured_outputs=spec), use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert greedy.text in choices and greedy.finish_reason == "stop" and greedy.logprobs is not None
    samples = llm.generate(["Pick:"], SamplingParams(n=4, seed=3, max_tokens=8, structured_outputs=spec),
                           use_tqdm=False)[0].outputs  # fmt: skip
    assert len(samples) == 4 and all(o.text in choices and o.finish_reason == "stop" for o in samples)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_completed_by_the_last_allowed_token_stops(llm: LLM, ignore_eos: bool) -> None:
    """An output whose grammar ends with exactly its max_tokens-th token (the grammar's end token, EOS) is
    whole: finish_reason "stop", as when it ends earlier, with or without ignore_eos."""
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])

    def run(max_tokens: int) -> Any:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                structured_outputs=spec)  # fmt: skip
        return llm.generate(["Pick:"], params, use_tqdm=False)[0].outputs[0]

    whole = run(16)
    assert whole.text in spec.choice and whole.finish_reason == "stop"  # type: ignore[operator]
    exact = run(len(whole.token_ids))
    assert (exact.token_ids, exact.text, exact.finish_reason) == (whole.token_ids, whole.text, "stop")


def test_bad_constraints_are_clear_errors_and_the_engine_serves_on(llm: LLM) -> None:
    # (the message says what is wrong: a Lark error's was its last line, the "^" under the grammar)
    cases = [
        ({"json": '{"type": "object", "properties": 5}'}, "json", ""),
        ({"json": "{not json"}, "json", ""),
        ({"regex": "(a|b"}, "regex", ""),
        ({"grammar": 'root ::= missing_rule'}, "grammar", "missing_rule"),
        ({"grammar": "start: missing_rule"}, "grammar", "line 1, column .*missing_rule"),
        ({"grammar": 'foo: "a"'}, "grammar", "no start rule"),
    ]
    for constraint, field, says in cases:
        with pytest.raises(InvalidRequestError, match=f"is not valid.*{says}") as info:
            llm.generate(["x"], _params(0, **constraint), use_tqdm=False)
        assert info.value.field == field
    for bad in ({}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"json": 5}):
        with pytest.raises(InvalidRequestError):
            StructuredOutputsParams(**bad)
    with pytest.raises(InvalidRequestError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))
    text, reason = _texts(llm, [_params(1, choice=["fine"])])[0]
    assert (text, reason) == ("fine", "stop")


def test_escapes_xgrammar_reads_as_letters_are_refused(llm: LLM) -> None:
    """xgrammar matched an escape it does not know as the letter itself: `[0-9]+\\Z` (Python's end of the
    text) gave "12Z", which the regex does not match."""
    for regex in (r"[0-9]+\Z", r"\Aab", r"x[\z]"):
        with pytest.raises(InvalidRequestError, match="not supported") as info:
            llm.engine.grammars.compile(StructuredOutputsParams(regex=regex))
        assert info.value.field == "regex"
    text, reason = _texts(llm, [_params(2, regex=r"\\Z[0-9]")])[0]  # an escaped backslash, then Z
    assert reason == "stop" and re.fullmatch(r"\\Z[0-9]", text), text


def test_a_regex_dot_takes_no_newline(llm: LLM) -> None:
    """xgrammar's `.` took a newline, Python's (and ECMA-262's) does not: `..`, with the newline's logit
    raised, finished "stop" with "\\n\\n"."""
    (newline,) = llm.get_tokenizer().encode("\n", add_special_tokens=False)
    for regex in ("..", r"a|.+", r".\.[.]"):  # an escaped dot and a dot in a class stay dots
        params = SamplingParams(max_tokens=8, seed=0, logit_bias={newline: 100},
                                structured_outputs=StructuredOutputsParams(regex=regex))  # fmt: skip
        out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" or re.fullmatch(regex, out.text), (regex, out.text)
    # a newline the regex names is still taken
    params = SamplingParams(max_tokens=8, logit_bias={newline: 100},
                            structured_outputs=StructuredOutputsParams(regex=r"[a-z\n]{3}"))  # fmt: skip
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("\n\n\n", "stop")


def test_choices_beyond_ascii(llm: LLM) -> None:
    choices = ["😀 yes", "no 😀", "café"]
    for text, reason in _texts(llm, [_params(s, choice=choices) for s in range(4)]):
        assert text in choices and reason == "stop", text


def test_workers_unpack_the_mask_and_refuse_a_malformed_one() -> None:
    vocab = 70  # three int32 words per row
    allowed = [{0, 5, 31, 32, 69}, {1, 63, 64}]
    words = torch.zeros(2, 3, dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= 1 << (t % 32)
    packed = words.numpy().astype("<u4").tobytes()
    masks = GrammarMasks(max_rows=4, vocab_size=vocab, device=torch.device("cpu"))
    rows, mask = masks.allowed(7, [8, 3], packed, [3, 4, 8])  # type: ignore[misc]
    assert rows.tolist() == [2, 0]
    assert [set(torch.nonzero(m).flatten().tolist()) for m in mask] == allowed
    assert masks.allowed(7, [], b"", [3]) is None
    for ids, data in (([8, 3], packed[:-4]), ([9, 3], packed), ([3, 3], packed)):
        with pytest.raises(ProtocolError, match="grammar bitmask"):
            masks.allowed(7, ids, data, [3, 4, 8])


def test_a_grammar_compiled_by_a_server_thread_is_not_compiled_again(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server compiles a request's constraint in its request thread; the engine thread's add_request
    then takes that grammar (by the StructuredOutputsParams object) without compiling it again."""
    import threading

    grammars = llm.engine.grammars
    spec = StructuredOutputsParams(regex="[pq]{3}")
    compiled: list[Any] = []
    worker = threading.Thread(target=lambda: compiled.append(grammars.compile(spec)))
    worker.start()
    worker.join()
    calls: list[StructuredOutputsParams] = []
    original = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda s: calls.append(s) or original(s))
    assert grammars.compile(spec) is compiled[0] and calls == []
    text, reason = _texts(llm, [SamplingParams(max_tokens=8, seed=2, structured_outputs=spec)])[0]
    assert re.fullmatch("[pq]{3}", text) and reason == "stop" and calls == []
    equal = StructuredOutputsParams(regex="[pq]{3}")  # another object: compiled (from xgrammar's cache)
    grammars.compile(equal)
    assert calls == [equal]


def test_logprobs_of_a_constrained_row_are_normalized_over_what_the_grammar_allows() -> None:
    """As in vLLM, the grammar's mask comes before the logprobs: at a choice's first token the chosen
    token's logprob is its unconstrained logprob less the logsumexp over the tokens the grammar allows
    there (every token whose text begins a choice, found by brute force over the vocabulary), and a
    token the grammar forbids has -inf."""
    with LLM("tiny-llama-tp", device="cpu", max_model_len=256, max_logprobs=1000) as llm:
        tok = llm.get_tokenizer()
        vocab = llm.engine.config.model.vocab_size
        texts = {t: tok.decode([t]) for t in range(vocab)}
        prompt = {"prompt_token_ids": [1, 37, 201, 5, 77]}
        greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=vocab)
        free = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
        raw = {t: lp.logprob for t, lp in free.logprobs[0].items()}
        assert len(raw) >= vocab
        words = [w for w in (texts[t] for t in range(3, vocab)) if w.isascii() and w.strip() and len(w) > 2]
        choices = [words[0], words[1]]
        allowed = [t for t, s in texts.items() if s and any(c.startswith(s) for c in choices)]
        assert len(allowed) >= 2
        spec = StructuredOutputsParams(choice=choices)
        constrained = SamplingParams(max_tokens=8, temperature=0, logprobs=5, structured_outputs=spec)
        out = llm.generate([prompt], constrained, use_tqdm=False)[0].outputs[0]
    assert out.text in choices
    first, chosen = out.logprobs[0], out.token_ids[0]
    norm = torch.logsumexp(torch.tensor([raw[t] for t in allowed], dtype=torch.float64), 0).item()
    assert first[chosen].logprob == pytest.approx(raw[chosen] - norm, abs=1e-4)
    for t, lp in first.items():
        if t not in allowed:
            assert lp.logprob == float("-inf"), (t, texts[t])


# A date that xgrammar's own "date" rule would let out as "2023-02-29": the structural tag's schemas are
# rewritten as `json` ones are.
TAGGED = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"],
          "additionalProperties": False}  # fmt: skip


def _valid_date(text: str) -> bool:
    import datetime

    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        return False
    return len(text) == 10


def test_structural_tags_in_xgrammars_form_and_vllms(llm: LLM) -> None:
    """xgrammar's form (a sequence: "<x>", a JSON value of TAGGED, "</x>") fixes the whole output; vLLM's
    (structures after triggers) leaves free text until a trigger, then its structure. Here "<" is the
    trigger and made the likeliest token (logit_bias), so structures follow one another: each finished
    one is "<f>" + TAGGED's JSON + "</f>", checked by hand."""
    sequence = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<x>"}, {"type": "json_schema", "json_schema": TAGGED},
        {"type": "const_string", "value": "</x>"}]}}  # fmt: skip
    for given in (sequence, json.dumps(sequence)):
        for text, reason in _texts(llm, [_params(seed, structural_tag=given) for seed in range(4)]):
            if reason != "stop":
                continue  # cut by max_tokens
            assert text.startswith("<x>") and text.endswith("</x>"), text
            assert _valid_date(json.loads(text[3:-4])["d"]), text
    vllm_form = {"structures": [{"begin": "<f>", "schema": TAGGED, "end": "</f>"}], "triggers": ["<"]}
    lt = llm.get_tokenizer().encode("<", add_special_tokens=False)
    assert len(lt) == 1
    found = 0
    for seed in range(4):
        spec = StructuredOutputsParams(structural_tag=vllm_form)
        params = SamplingParams(max_tokens=120, seed=seed, logit_bias={lt[0]: 30.0}, structured_outputs=spec)
        text = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0].text
        assert text.startswith("<f>"), text
        for part in text.split("</f>")[:-1]:
            assert part.startswith("<f>"), text
            assert _valid_date(json.loads(part[3:])["d"]), text
            found += 1
    assert found >= 4
    other_form = {"type": "structural_tag", "format": {"type": "x"}}
    bad: list[tuple[Any, str]] = [
        ("not json", "not valid JSON"),
        ({"structures": [{"begin": "<f>"}], "triggers": ["<"]}, "structures"),
        ({"structures": [], "triggers": []}, "triggers"),
        (other_form, "structural tag is not valid"),
    ]
    # Each schema and regex in a tag is checked as a `json` or `regex` one is (a format that cannot be
    # enforced, an octal escape are refused); a format node without its type (which xgrammar would take
    # as a schema, unchecked) is refused, and so are excludes beside length bounds (xgrammar drops them).
    unenforced = {"type": "string", "format": "idn-email"}
    bad += [
        ({**vllm_form, "structures": [{"begin": "<f>", "schema": unenforced, "end": "</f>"}]}, "idn-email"),
        ({"type": "structural_tag", "format": {"type": "json_schema", "json_schema": unenforced}},
         "in the structural tag, the JSON schema is not supported: 'format' 'idn-email'"),
        ({"type": "structural_tag", "format": {"type": "sequence", "elements": [{"json_schema": TAGGED}]}},
         "not valid: .* at format.sequence.elements.0"),
        ({"type": "structural_tag", "format": {"type": "regex", "pattern": "a\\01"}}, "octal escape"),
        ({"type": "structural_tag", "format": {"type": "json_schema", "excludes": ["zz"],
                                               "json_schema": {"type": "string", "maxLength": 2}}},
         "excludes beside minLength/maxLength"),
    ]  # fmt: skip
    for given, message in bad:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            llm.generate(["x"], _params(0, structural_tag=given), use_tqdm=False)
        assert caught.value.field == "structural_tag"
    assert _texts(llm, [_params(0, max_tokens=4)])[0][0]  # serving on


def test_structural_tag_strings_with_long_bounds_stay_json(llm: LLM) -> None:
    """A length-bounded string inside a structural tag's schema (a tool's argument) took raw control
    characters too, under xgrammar's own rule: it gets a JSON string character's rule in both forms."""
    arg = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 2000}}, "required": ["q"],
           "additionalProperties": False}  # fmt: skip
    sequence = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<x>"}, {"type": "json_schema", "json_schema": arg},
        {"type": "const_string", "value": "</x>"}]}}  # fmt: skip
    vllm_form = {"structures": [{"begin": "<x>", "schema": arg, "end": "</x>"}], "triggers": ["<x>"]}
    grammars, tokenizer = llm.engine.grammars, llm.get_tokenizer()
    for tag in (sequence, vllm_form):
        compiled = grammars.compile(StructuredOutputsParams(structural_tag=tag))
        for value, takes in (('"a\\tb\\u0017"', True), ('"a\tb"', False), ('"a\x17"', False)):
            state = grammars.matcher(compiled)
            ids = tokenizer.encode('<x>{"q": ' + value + "}</x>", add_special_tokens=False)
            assert all(state.accept(i) for i in ids) == takes, (tag, value)



def test_schemas_and_regexes_deep_in_a_structural_tag_are_enforced(llm: LLM) -> None:
    """Wherever xgrammar's format holds a schema (a tag's content among triggered tags, Qwen's XML
    parameters) or a regex, it takes exactly what the schema or regex given alone takes: "2023-02-29" is
    no date, and a regex dot no newline (xgrammar's own rules let both out)."""
    import xgrammar

    def takes(tag: dict[str, Any], text: str) -> bool:
        compiled = llm.engine.grammars.compile(StructuredOutputsParams(structural_tag=tag))
        matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())

    tags = [{"begin": "<f>", "content": {"type": "json_schema", "json_schema": TAGGED}, "end": "</f>"}]
    triggered = {"type": "structural_tag",
                 "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": tags}}  # fmt: skip
    assert takes(triggered, 'so <f>{"d": "2024-02-29"}</f>')
    assert not takes(triggered, 'so <f>{"d": "2023-02-29"}</f>')
    xml = {"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": TAGGED}}
    assert takes(xml, "<parameter=d>2024-02-29</parameter>")
    assert not takes(xml, "<parameter=d>2023-02-29</parameter>")
    dot = {"type": "structural_tag", "format": {"type": "regex", "pattern": "a.b"}}
    assert takes(dot, "a-b") and not takes(dot, "a\nb")
