"""Incremental detokenization against the tokenizer's own full decode: streamed text never holds anything a
later token changes, so the pieces join into the final text, and stop strings fire at the first token
whose text holds them.

Tokenizer families, all built here: SentencePiece-style byte fallback (Llama 2, Mistral: byte tokens
<0xE4>, whose runs that are not valid UTF-8 decode to one U+FFFD per byte, also bytes already decoded to
a character), byte-level BPE (GPT-2, Llama 3, Qwen: only an unfinished last character changes),
SentencePiece's own decoder (byte fallback too, but it keeps the valid characters of a run), and
WordPiece. The reference is always the tokenizer's decode of the whole token list.
"""

from __future__ import annotations

import io
import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_streaming_engine import (
    ScriptedExecutor,
    byte_level_tokenizer,
    joined,
    make_engine,
    run_all,
    text_script,
)

from tp_runtime import LLM, SamplingParams
from tp_runtime.config import build_model_config
from tp_runtime.engine.llm_engine import (
    IncrementalDetokenizer,
    TextFinality,
    decode_context,
    output_text,
)
from tp_runtime.server.openai_format import TextOffsets

VOCAB = 300
FFFD = "\ufffd"
# Characters of 1 to 4 bytes in UTF-8.
CHARS = ["A", " ", "é", "ö", "中", "€", "日", "🥨", "🎉"]
WORDS = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁stop", "中", "日本", "▁ok", "é", "▁x", "ab", "."]


def byte_fallback_tokenizer() -> Any:
    """Llama 2's layout: <unk> <s> </s>, the 256 byte tokens <0x00>..<0xFF> (ids 3 + byte) in the model's
    vocabulary, then Metaspace pieces; byte fallback for what the pieces do not cover, and Llama 2's
    decoder (▁ to space, ByteFallback, Fuse, strip the text's first space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for word in WORDS:
        vocab.setdefault(word[0], len(vocab))
        for end in range(2, len(word) + 1):
            vocab.setdefault(word[end - 1], len(vocab))
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
    ])  # fmt: skip
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def wordpiece_tokenizer(clean_up_tokenization_spaces: bool = False) -> Any:
    """BERT-style: WordPiece with ## continuations and the decoder's own cleanup of each token (" ." to
    "."); with clean_up_tokenization_spaces, transformers' too, on the whole text ("don ' t" to "don't")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "the", "cat", "##s", "don", "'", "t", "##'", "##t", "n",
              ".", ",", "?", "!", "a", "é", "中", "##中", "x", "##x", "stop", "s", "m", "ve", "re",
              "##n"]  # fmt: skip
    tok = Tokenizer(models.WordPiece(vocab={p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        clean_up_tokenization_spaces=clean_up_tokenization_spaces,
    )  # fmt: skip


def sentencepiece_processor() -> Any:
    """A SentencePiece model with byte fallback, trained here; decoded by SentencePiece itself."""
    import sentencepiece as spm

    corpus = ["The capital of France is Paris.", "the cat sat on the mat", "ok then, stop"] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


class SentencePieceTokenizer:
    """What TextFinality.of looks up, over a SentencePieceProcessor."""

    def __init__(self, sp: Any) -> None:
        self.sp = sp

    def convert_tokens_to_ids(self, piece: str) -> int:
        return int(self.sp.piece_to_id(piece))

    def convert_ids_to_tokens(self, token: int) -> str:
        return str(self.sp.id_to_piece(token))


class Family:
    """A tokenizer, how the engine decodes with it, and what random outputs are made of."""

    def __init__(self, name: str, tokenizer: Any, decode: Callable[[list[int]], str],
                 byte: Callable[[int], int] | None, words: list[int], specials: list[int],
                 size: int) -> None:  # fmt: skip
        self.name, self.tokenizer, self.decode, self.byte = name, tokenizer, decode, byte
        self.words, self.specials, self.size = words, specials, size
        self.finality = TextFinality.of(tokenizer, decode)

    def bytes_of(self, data: bytes) -> list[int]:
        assert self.byte is not None
        return [self.byte(b) for b in data]

    def random_ids(self, rng: random.Random, length: int) -> list[int]:
        """Runs of byte tokens (whole characters, cut ones, bytes that are never UTF-8, ASCII bytes)
        among words, special tokens and any token of the vocabulary."""
        ids: list[int] = []
        while len(ids) < length:
            kind = rng.random()
            if self.byte is not None and kind < 0.5:
                data = rng.choice(CHARS).encode()
                if rng.random() < 0.3:
                    data = data[: rng.randrange(1, len(data) + 1)]
                if rng.random() < 0.15:
                    data = bytes([rng.choice([0xFF, 0x80, 0xC3, 0xE4, 0x41, 0x20])])
                ids += self.bytes_of(data)
            elif kind < 0.75:
                ids.append(rng.choice(self.words))
            elif kind < 0.82:
                ids.append(rng.choice(self.specials))
            else:
                ids.append(rng.randrange(self.size))
        return ids[:length]


def hf_family(name: str, tokenizer: Any, skip: bool, byte: Callable[[int], int] | None) -> Family:
    words = [i for i in range(len(tokenizer)) if not tokenizer.convert_ids_to_tokens(i).startswith("<")]
    specials = list(tokenizer.all_special_ids)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=skip))

    return Family(name, tokenizer, decode, byte, words, specials, len(tokenizer))


BYTE_LEVEL_EXTRA = [b"P\xe2\x82", b"\xe4\xb8", b"\xad ok", b" the", b"\xe2\x82\xac", b"\xb8\xad"]


def families() -> Iterator[Family]:
    bf = byte_fallback_tokenizer()
    bl = byte_level_tokenizer(BYTE_LEVEL_EXTRA)
    wp = wordpiece_tokenizer()
    for skip in (True, False):
        yield hf_family(f"byte-fallback-skip{skip}", bf, skip, lambda b: 3 + b)
        yield hf_family(f"byte-level-skip{skip}", bl, skip, lambda b: 3 + b)
        yield hf_family(f"wordpiece-skip{skip}", wp, skip, None)
    yield hf_family("wordpiece-cleanup", wordpiece_tokenizer(clean_up_tokenization_spaces=True), True, None)
    sp = sentencepiece_processor()
    words = [i for i in range(sp.get_piece_size()) if not sp.id_to_piece(i).startswith("<")]
    yield Family(
        "sentencepiece", SentencePieceTokenizer(sp), lambda ids: str(sp.decode(ids)),
        lambda b: int(sp.piece_to_id(f"<0x{b:02X}>")), words, [1, 2], sp.get_piece_size(),
    )  # fmt: skip


FAMILIES = {f.name: f for f in families()}


def adversarial(f: Family) -> list[list[int]]:
    """Hand-made outputs: where a later byte rewrites text that bytes made, or completes a character; where
    a cleanup of tokenization spaces matches across the pieces ("a ' ' the" is "a'' the")."""
    if f.byte is None:
        vocab = f.tokenizer.get_vocab()
        spelled = [
            "a ' ' the cat cat", "' ' ' t", "a ' ' ' ' the", "don ' t ' s", "a . ' s", "x ' ' m ' ve",
            "the ' ' , ' re !", "n ' ' ' ' ' t",
        ]  # fmt: skip
        return [[vocab[p] for p in text.split()] for text in spelled]
    b, word, special = f.bytes_of, f.words[0], f.specials[-1]
    zhong = b("中".encode())
    return [
        [*zhong, *b(b"\xff"), word],  # a whole character, then a byte that spoils the run
        [*zhong, word, *b(b"\xff")],  # a word ends the run first
        [word, *zhong, *b("€".encode()), word],  # two characters in one run
        [word, *zhong],  # the run ends the output, whole
        [word, *zhong[:2]],  # the run ends the output, cut
        [*b(b"AB\xff"), word],  # ASCII bytes, then garbage
        [*b(b"\xff\x80"), *b("é".encode()), word],  # garbage, then a character in the same run
        [*b(b"\xe4"), special, *b(b"\xb8\xad"), word],  # a special token inside a character's bytes
        [*b(b" "), word, *b(b" x")],  # a space byte at the start (a decoder may strip it)
        [*b("🥨".encode()[:3]), *b("🥨".encode()), *b(b"\xad"), word],
    ]


def reference(f: Family, anchor: int | None, ids: list[int]) -> str:
    """The output's text as the tokenizer decodes it: alone, or after `anchor`, the prompt's last token
    that is not a byte (bytes after it cannot join the output's: their text would change with it)."""
    if anchor is None:
        return f.decode(ids)
    head = f.decode([anchor])
    full = f.decode([anchor, *ids])
    assert full.startswith(head)
    return full[len(head) :]


def prompts(f: Family) -> list[tuple[list[int], int | None]]:
    """Prompts, with the token the output's text follows (reference)."""
    word, bos = f.words[1], f.specials[0]
    out: list[tuple[list[int], int | None]] = [([], None), ([bos], bos), ([word], word)]
    if f.byte is not None:
        b = f.bytes_of
        out += [
            ([word, *b("中".encode())], word),  # a whole character of bytes: the output may spoil it
            ([word, *b("中".encode())[:2]], word),  # a cut one: the output may complete it
            ([word, *b(b"AB\xc3")], word),
            ([word, *b("中中".encode())], word),  # more bytes than the context's 5 tokens
        ]
    return out


def continuations(f: Family) -> list[list[int]]:
    """Tokens that may come next, to try on every prefix: a streamed text must stay with each."""
    nexts = [[f.words[2]], [f.specials[-1]], [f.words[0], f.words[3]]]
    if f.byte is not None:
        nexts += [f.bytes_of(x) for x in (b"\xff", b"\x80", b"\xad", b"A", b"\xb8\xad", b"\xe4", b" ")]
    else:  # WordPiece: every token, and pairs that may complete a cleanup pattern (" n't", " ' ")
        nexts += [[t] for t in f.words]
        vocab = f.tokenizer.get_vocab()
        small = [vocab[p] for p in ("'", "##'", "n", "##n", "t", "s", "ve", ".") if p in vocab]
        nexts += [[a, b] for a in small for b in small]
    return nexts


def stream(f: Family, prompt: list[int], ids: list[int]) -> tuple[IncrementalDetokenizer, list[int]]:
    context = decode_context(f.decode, prompt, f.finality)
    return IncrementalDetokenizer(f.decode, context, f.finality), context


def outputs(f: Family, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return adversarial(f) + [f.random_ids(rng, rng.randrange(1, 30)) for _ in range(40)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_streamed_text_is_final_text(name: str) -> None:
    """After every token, the detokenizer's text begins the text of the tokens so far and of every
    continuation tried, its text + pending is the whole decode (where that does not end in U+FFFD), and
    the final text is the tokenizer's decode."""
    f = FAMILIES[name]
    for prompt, word in prompts(f):
        for ids in outputs(f, seed=len(prompt)):
            detok, context = stream(f, prompt, ids)
            pending = ""
            for n in range(1, len(ids) + 1):
                before = detok.text
                changed = detok.step(ids[:n])
                now = reference(f, word, ids[:n])
                assert detok.text.startswith(before), (ids, n)
                assert now.startswith(detok.text), (ids, n, detok.text, now)
                for more in continuations(f):
                    later = reference(f, word, ids[:n] + more)
                    assert later.startswith(detok.text), (ids[:n], more, detok.text, later)
                previous = before + pending
                if changed is not None:  # the text as vLLM's detokenizer makes it, whose start stays
                    assert detok.text + detok.pending == now, (ids, n)
                    assert changed <= len(previous) and previous[:changed] == now[:changed], (ids, n)
                else:  # the tokens end inside a character, or add nothing
                    assert detok.text + detok.pending == previous, (ids, n)
                    assert now.endswith(FFFD) or now == previous, (ids, n, now, previous)
                pending = detok.pending
            assert output_text(f.decode, context, ids) == reference(f, word, ids), (prompt, ids)


def test_the_probe_is_only_where_a_byte_rewrites_text() -> None:
    """Only the byte-fallback decoder (a run that is not UTF-8 decodes to one U+FFFD per byte) needs
    the probe; byte-level BPE and SentencePiece's own decoder keep the text before a stray byte, and a
    vocabulary without byte tokens has none. Only transformers' cleanup of tokenization spaces needs tails,
    not where it is asked for a BPE tokenizer (transformers leaves those alone)."""
    probes = {name: f.finality.probe for name, f in FAMILIES.items()}
    assert probes["byte-fallback-skipTrue"] == probes["byte-fallback-skipFalse"] == 3 + 0xFF
    assert all(p is None for name, p in probes.items() if not name.startswith("byte-fallback")), probes
    f = FAMILIES["byte-fallback-skipTrue"]
    assert f.decode(f.bytes_of("中".encode())) == "中"
    assert f.decode(f.bytes_of("中".encode() + b"\xff")) == FFFD * 4  # the run's text changes
    tails = {name for name, f in FAMILIES.items() if f.finality.tails}
    assert tails == {"wordpiece-cleanup"}
    assert set(FAMILIES["wordpiece-cleanup"].finality.tails) >= {" ", " '", " n", " n'"}
    from transformers import PreTrainedTokenizerFast

    bpe = byte_level_tokenizer([])
    flagged = PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend_tokenizer, unk_token="<unk>", clean_up_tokenization_spaces=True
    )
    assert TextFinality.of(flagged, flagged.decode) == TextFinality()


@pytest.mark.parametrize("name", ["byte-fallback-skipTrue", "byte-level-skipTrue"])
def test_plain_tokens_cost_two_decodes_each(name: str) -> None:
    """The common path: after a token that is not a byte (nor special), the detokenizer decodes the
    previous piece and the window, as before; the byte-run probe is tried only after byte tokens (and
    after special ones, which a run may go on through), whatever the family (one more decode per new token
    id, once)."""
    f = FAMILIES[name]
    calls = []

    def counting(ids: list[int]) -> str:
        calls.append(len(ids))
        return f.decode(ids)

    words = [f.tokenizer.convert_tokens_to_ids(w) for w in ("▁the", "▁cat", "▁sat", "▁on", "▁mat")]
    if name.startswith("byte-level"):
        words = [3 + b for b in b"the cat"]
    ids = [words[i % len(words)] for i in range(200)]
    detok = IncrementalDetokenizer(counting, [1], f.finality)
    for n in range(1, len(ids) + 1):
        detok.step(ids[:n])
    assert detok.text == f.decode(ids)
    assert len(calls) <= 2 * len(ids) + len(words), len(calls)


def test_a_cleanup_tokenizer_decodes_its_text_once_a_token() -> None:
    """With a cleanup of tokenization spaces each window starts at the text's start: one decode per token
    (the prefix's decode is the previous window's), not two."""
    f = FAMILIES["wordpiece-cleanup"]
    calls = []

    def counting(ids: list[int]) -> str:
        calls.append(len(ids))
        return f.decode(ids)

    vocab = f.tokenizer.get_vocab()
    ids = [vocab[w] for w in ("the", "cat", "don", "'", "t", "a", ".")] * 30
    detok = IncrementalDetokenizer(counting, [], f.finality)
    for n in range(1, len(ids) + 1):
        detok.step(ids[:n])
    assert detok.text + detok.pending == f.decode(ids)
    assert len(calls) <= len(ids) + 2, len(calls)


def _held_reference(f: Family, word: int | None, ids: list[int]) -> list[int]:
    """Brute force: token i starts where the text of the tokens before it stops agreeing with the whole
    text."""
    text = reference(f, word, ids)
    want = []
    for i in range(len(ids)):
        before = reference(f, word, ids[:i])
        same = 0
        while same < min(len(before), len(text)) and before[same] == text[same]:
            same += 1
        want.append(same)
    return want


@pytest.mark.parametrize("name", ["byte-fallback-skipTrue", "byte-fallback-skipFalse", "byte-level-skipTrue"])
def test_text_offsets_follow_the_held_text(name: str) -> None:
    """held_chars_kept through the server's TextOffsets: offsets never go back, never pass the text, never
    pass the brute force (which knows the whole text), and equal it for each token that is not a byte, a
    special token or part of a character (what the bytes before it made is settled then)."""
    f = FAMILIES[name]
    skip = name.endswith("True")
    for prompt, word in prompts(f)[:3]:
        for ids in outputs(f, seed=7):
            offsets = TextOffsets(f.tokenizer, with_special_tokens=not skip, prompt=prompt)
            got = [offsets.next(t) for t in ids]
            want = _held_reference(f, word, ids)
            text = reference(f, word, ids)
            assert got == sorted(got) and got[-1] <= len(text), (ids, got)
            assert all(g <= w for g, w in zip(got, want, strict=True)), (ids, got, want)
            settled = [  # tokens that are not bytes, special or part of a character
                i for i, t in enumerate(ids)
                if not f.tokenizer.convert_ids_to_tokens(t).startswith("<") and FFFD not in f.decode([t])
            ]  # fmt: skip
            assert [got[i] for i in settled] == [want[i] for i in settled], (ids, got, want)


# ----------------------------------------------------------------------------------- the engine
ENGINE_FAMILIES = ["byte-fallback-skipTrue", "byte-level-skipTrue", "wordpiece-skipTrue", "wordpiece-cleanup"]


@pytest.fixture(scope="module")
def model_config(make_checkpoint: Callable[..., Path]) -> Any:
    return build_model_config(make_checkpoint(seed=3), max_model_len=128)


def engine_prompts(f: Family) -> list[tuple[list[int], int | None]]:
    """Prompts as the engine takes them (not empty)."""
    return [(p, w) for p, w in prompts(f) if p]


@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_engine_streams_join_into_the_decoded_text(model_config: Any, name: str) -> None:
    """Streamed pieces join into the text a request that does not stream gets, which is the tokenizer's
    decode, for random and hand-made outputs after prompts that end in words and in byte tokens."""
    f = FAMILIES[name]
    rng = random.Random(5)
    cases = adversarial(f) + [f.random_ids(rng, rng.randrange(1, 30)) for _ in range(12)]
    for prompt, word in engine_prompts(f):
        for ids in cases:
            engine = make_engine(model_config, f.tokenizer, ScriptedExecutor(text_script(ids, len(prompt))))
            params = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True)
            streamed = engine.add_request(prompt, params, stream=True)
            whole = engine.add_request(prompt, params)
            out = run_all(engine)
            text, token_ids = joined(out[str(streamed)])
            assert token_ids == ids
            want = reference(f, word, ids)
            assert text == out[str(whole)][0].outputs[0].text == want, (prompt, ids, text, want)


def first_stop(f: Family, word: int | None, ids: list[int], stops: list[str], include: bool) -> Any:
    """Brute force: the first token after which the decode of the tokens so far holds a stop string,
    where that decode does not end inside a character (U+FFFD: vLLM's detokenizer waits for the character
    there), or at the last token; the text up to the stop string there that ends first (first listed on a
    tie)."""
    for n in range(1, len(ids) + 1):
        text = reference(f, word, ids[:n])
        if text.endswith(FFFD) and n < len(ids):
            continue
        hits = [(text.find(s) + len(s), i) for i, s in enumerate(stops) if s in text]
        if hits:
            stop_end, i = min(hits)
            return n, text[: stop_end - (0 if include else len(stops[i]))], stops[i]
    return None


def stop_cases(f: Family, rng: random.Random) -> Iterator[tuple[list[int], list[str]]]:
    """Outputs with stop strings that their byte tokens complete ("中", "é"), that span a run and a word,
    that hold U+FFFD, and pieces of the text picked at random."""
    if f.byte is not None:
        b = f.bytes_of
        word = f.words[0]
        wtext = f.decode([f.words[1], word])[len(f.decode([f.words[1]])) :]
        yield [word, *b("中".encode()), *b(b"\xff"), word], ["中"]
        yield [word, *b("中".encode()), word], ["中" + wtext[:2]]
        yield [word, *b("中".encode()), *b(b"\xff"), word], [FFFD * 2, "zz"]
        yield [word, *b("é".encode()), *b("中".encode()), word], ["中", "é"]
        yield [*b(b"AB"), *b(b"\x80"), word], ["B"]
    for ids in adversarial(f) if f.byte is None else []:  # stop strings across a cleaned-up quote
        text = f.decode(ids)
        if "'" in text:
            yield ids, [text[text.index("'") : text.index("'") + 3], "zzz"]
    for _ in range(25):
        ids = f.random_ids(rng, rng.randrange(2, 25))
        text = f.decode(ids)
        if len(text) < 2:
            continue
        start = rng.randrange(len(text) - 1)
        yield ids, [text[start : start + rng.randrange(1, 4)], "zzz"]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("name", ["byte-fallback-skipTrue", "byte-level-skipTrue", "wordpiece-cleanup"])
def test_stop_strings_fire_where_the_brute_force_finds_them(
    model_config: Any, name: str, include: bool
) -> None:
    """A stop string ends the request at the first token whose text (the decode of the tokens so far)
    holds it, also one that byte tokens complete whose run a later byte would spoil; streamed and whole
    requests end alike, and the text stops where it begins (or ends, include_stop_str_in_output)."""
    f = FAMILIES[name]
    rng = random.Random(11)
    word = f.words[1]
    prompt = [f.specials[0], word]
    for ids, stops in stop_cases(f, rng):
        want = first_stop(f, word, ids, stops, include)
        engine = make_engine(model_config, f.tokenizer, ScriptedExecutor(text_script(ids, len(prompt))))
        params = SamplingParams(
            temperature=0, max_tokens=len(ids), ignore_eos=True, stop=stops,
            include_stop_str_in_output=include,
        )  # fmt: skip
        streamed, whole = engine.add_request(prompt, params, stream=True), engine.add_request(prompt, params)
        out = run_all(engine)
        text, token_ids = joined(out[str(streamed)])
        final = out[str(whole)][0].outputs[0]
        assert (text, token_ids) == (final.text, final.token_ids), (ids, stops)
        last = out[str(streamed)][-1].outputs[0]
        assert (last.finish_reason, last.stop_reason) == (final.finish_reason, final.stop_reason)
        if want is None:
            assert final.finish_reason == "length" and token_ids == ids
            assert text == reference(f, word, ids)
        else:
            n, stop_text, stop = want
            assert (final.finish_reason, final.stop_reason) == ("stop", stop), (ids, stops, token_ids)
            assert token_ids == ids[:n], (ids, stops, len(token_ids), n)
            assert text == stop_text, (ids, stops, text, stop_text)
        # No piece ran past where the final text ends.
        sent = ""
        for d in out[str(streamed)][:-1]:
            sent += d.outputs[0].text
            assert text.startswith(sent)


@pytest.fixture(scope="module")
def byte_fallback_llm(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LLM]:
    """The tiny random Llama with the byte-fallback tokenizer: most of its vocabulary is byte tokens,
    so sampled text is full of runs, most of them not UTF-8."""
    path = tmp_path_factory.mktemp("byte-fallback") / "model"
    shutil.copytree(make_checkpoint(seed=3), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    byte_fallback_tokenizer().save_pretrained(path)
    with LLM(str(path), device="cpu", max_model_len=128, max_num_seqs=8) as llm:
        yield llm


def test_a_real_model_streams_the_text_generate_gives(byte_fallback_llm: LLM) -> None:
    """Sampled outputs of a real (tiny, random) model: streamed through the engine they join into the text
    generate() gives, the tokenizer's decode; and a stop string taken from one stops both alike."""
    llm = byte_fallback_llm
    tok = llm.get_tokenizer()
    f = hf_family("loaded", tok, True, lambda b: 3 + b)
    assert f.finality.probe == 3 + 0xFF
    word = tok.convert_tokens_to_ids("▁the")
    prompts = [[1, word], [1, word, *f.bytes_of("中".encode())], [1, word, 3 + 0xE4]]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True) for s in range(3)]
    cases = [(p, sp) for p in prompts for sp in params]
    whole = llm.generate([{"prompt_token_ids": p} for p, _ in cases], [sp for _, sp in cases], use_tqdm=False)
    engine = llm.engine
    streamed = [engine.add_request(p, sp, stream=True) for p, sp in cases]
    out = run_all(engine)
    spoiled = 0
    for req, ref in zip(streamed, whole, strict=True):
        text, token_ids = joined(out[str(req)])
        ids = ref.outputs[0].token_ids
        assert token_ids == ids
        assert text == ref.outputs[0].text == reference(f, word, ids), (ids, text)
        spoiled += text.count(FFFD)
    assert spoiled > 10, "the model should sample runs of bytes that are not UTF-8"
    # Stop strings: a piece of each output's text (brute force on its tokens).
    stopped_cases = []
    for ref, (prompt, sp) in zip(whole, cases, strict=True):
        ids, text = ref.outputs[0].token_ids, ref.outputs[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        want = first_stop(f, word, ids, [stop], include=False)
        assert want is not None
        params = SamplingParams(temperature=1.0, seed=sp.seed, max_tokens=30, ignore_eos=True, stop=stop)
        stopped_cases.append((prompt, params, ids[: want[0]], want[1]))
    stopped = llm.generate(
        [{"prompt_token_ids": p} for p, *_ in stopped_cases], [sp for _, sp, *_ in stopped_cases],
        use_tqdm=False,
    )  # fmt: skip
    streamed = [engine.add_request(p, sp, stream=True) for p, sp, *_ in stopped_cases]
    out = run_all(engine)
    for req, ref, (_, sp, want_ids, want_text) in zip(streamed, stopped, stopped_cases, strict=True):
        streamed_text, token_ids = joined(out[str(req)])
        assert token_ids == ref.outputs[0].token_ids == want_ids, (want_ids, sp.stop)
        assert streamed_text == ref.outputs[0].text == want_text, (want_ids, sp.stop)
