"""IncrementalDetokenizer: streamed text equals a full decode, UTF-8 and spaces survive
token boundaries, stop strings are never partly emitted.

Two real tokenizers: SmolLM2's byte-level BPE, and a Llama-style SentencePiece BPE
(``▁`` spaces, byte fallback for characters it never saw) trained here on a tiny corpus.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.detokenizer.incremental import IncrementalDetokenizer

CHAT_TAIL = [1, 520, 9531, 198]  # SmolLM2 "<|im_start|>assistant\n"
EOS = 2  # SmolLM2 <|im_end|>

TEXTS = [
    "Hello, world! How are you today?",
    "  two leading spaces,   three inside\n\nand\ttabs ",
    "naïve café, résumé; déjà vu. Ærøskøbing Straße",
    "中文字符测试，你好世界。日本語のテキスト",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 end",
    "Ελληνικά ქართული עברית العربية",
    "combining e\u0301 and n\u0303; math ∑∫√ ≠ ≤",
    "mixed: ascii中文😀é at once!!",
]


def build_sentencepiece_tokenizer():
    """A Llama-style tokenizer (BPE over ``▁``-joined words, byte fallback, Llama's decoder)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The cat sat on the mat.",
        "A quick brown fox jumps over the lazy dog!",
        "naïve café, résumé; déjà vu.",
        "Hello world, hello there. How are you today?",
        "Numbers 123 and 4567, plus symbols #@%.",
    ] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # Llama's <0xNN> byte tokens: unseen characters become UTF-8 bytes
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def smol(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def sp():
    return build_sentencepiece_tokenizer()


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tok(request, smol, sp):
    return smol if request.param == "smollm2" else sp


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1, finish: bool = True) -> list[str]:
    """Feed ``ids`` in chunks; return every delta (the last one from ``finish()``)."""
    deltas = [det.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    if finish:
        deltas.append(det.finish())
    return deltas


# ---------------------------------------------------------------------- text == decode


def test_tokenizers_split_characters_into_byte_tokens(smol, sp):
    """The texts below do put multi-byte characters across token boundaries."""
    for t in (smol, sp):
        ids = encode(t, "中文字符测试 😀👍🏽")
        assert any(t.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    assert "<0xF0>" in sp.convert_ids_to_tokens(encode(sp, "😀"))


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tok, text, chunk):
    ids = encode(tok, text)
    deltas = stream(IncrementalDetokenizer(tok), ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas), deltas
    if tok.decode(ids) == text:  # the tokenizer round-trips it (SentencePiece: only without "▁" start)
        assert "".join(deltas) == text


def test_text_is_not_emitted_before_a_character_is_complete(smol):
    ids = encode(smol, "😀")
    assert len(ids) > 1  # one emoji, several byte tokens
    det = IncrementalDetokenizer(smol)
    assert [det.add_tokens([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_chat_prompt_tail_does_not_change_byte_level_text(smol):
    text = "Sure! Here is 中文 😀."
    ids = encode(smol, text)
    assert "".join(stream(IncrementalDetokenizer(smol, CHAT_TAIL), ids)) == text


def test_sentencepiece_first_token_keeps_its_space_after_prompt_context(sp):
    ids = encode(sp, "The cat sat on the mat.")
    prompt, out = ids[:2], ids[2:]
    assert sp.convert_ids_to_tokens(out)[0].startswith("▁")
    assert sp.decode(out) == "sat on the mat."  # a plain decode drops the leading space
    deltas = stream(IncrementalDetokenizer(sp, prompt), out)
    assert deltas[0] == " sat"
    assert "".join(deltas) == " sat on the mat."
    assert sp.decode(prompt) + "".join(deltas) == sp.decode(ids)
    # without context the stream is the plain decode
    assert "".join(stream(IncrementalDetokenizer(sp), out)) == "sat on the mat."


def test_sentencepiece_space_survives_a_skipped_special_token(sp):
    ids = encode(sp, "The cat sat")
    eos = sp.convert_tokens_to_ids("</s>")
    det = IncrementalDetokenizer(sp, ids[:1])
    assert det.add_tokens([ids[1]]) == " cat"
    assert det.add_tokens([eos]) == ""
    assert det.add_tokens([ids[2]]) == " sat"


def test_eos_text_left_out_when_stop_terminated(smol):
    ids = encode(smol, "Done.")
    det = IncrementalDetokenizer(smol, CHAT_TAIL, skip_special_tokens=False)
    assert det.add_tokens(ids + [EOS], stop_terminated=True) + det.finish() == "Done."
    assert det.num_consumed_tokens == len(ids) + 1
    det = IncrementalDetokenizer(smol, CHAT_TAIL, skip_special_tokens=False)
    assert det.add_tokens(ids + [EOS]) + det.finish() == "Done.<|im_end|>"
    det = IncrementalDetokenizer(smol, CHAT_TAIL, skip_special_tokens=True)
    assert det.add_tokens(ids + [EOS]) + det.finish() == "Done."


def test_incomplete_utf8_tail_is_flushed_by_finish(smol):
    ids = encode(smol, "ok 😀")
    cut = ids[:-1]  # the emoji's last byte never arrives
    det = IncrementalDetokenizer(smol)
    deltas = stream(det, cut)
    assert "".join(deltas) == smol.decode(cut)
    assert deltas[-1].endswith("\ufffd") and "\ufffd" not in "".join(deltas[:-1])


# ---------------------------------------------------------------------- stop strings


def _check_stream(det, ids, expected: str, chunk: int = 1) -> list[str]:
    """Every cumulative output is a prefix of ``expected``; the whole output equals it."""
    deltas, seen = [], ""
    for i in range(0, len(ids), chunk):
        deltas.append(det.add_tokens(ids[i : i + chunk]))
        seen += deltas[-1]
        assert expected.startswith(seen), (seen, expected)
    deltas.append(det.finish())
    assert "".join(deltas) == expected
    return deltas


def test_stop_string_spanning_token_boundaries(smol):
    text = "The quick brown fox jumps over the lazy dog"
    ids = encode(smol, text)
    stop = "own fo"
    assert not any(stop in smol.decode([i]) for i in ids)  # it spans tokens
    det = IncrementalDetokenizer(smol, stop=[stop])
    _check_stream(det, ids, "The quick br")
    assert det.stop_matched == stop and det.finished
    assert det.num_consumed_tokens == 4  # "The", " quick", " brown", " fox"
    assert det.add_tokens(ids[:2]) == "" and det.num_consumed_tokens == 4


def test_stop_string_include_in_output(smol):
    ids = encode(smol, "The quick brown fox jumps over the lazy dog")
    det = IncrementalDetokenizer(smol, stop=["own fo"], include_stop_str_in_output=True)
    _check_stream(det, ids, "The quick brown fo")
    assert det.stop_matched == "own fo"


def test_earliest_of_several_stop_strings_wins(smol):
    ids = encode(smol, "The quick brown fox jumps over the lazy dog")
    det = IncrementalDetokenizer(smol, stop=["dog", "fox", "quick"])
    _check_stream(det, ids, "The ")
    assert det.stop_matched == "quick"
    # both inside the one token " brown": "ro" completes before "own"
    det = IncrementalDetokenizer(smol, stop=["own", "ro"])
    assert det.add_tokens(ids) == "The quick b"
    assert det.stop_matched == "ro" and det.num_consumed_tokens == 3


def test_partial_match_is_held_then_released(smol):
    ids = encode(smol, "The quick brown fox jumps over the lazy dog")
    det = IncrementalDetokenizer(smol, stop=[" lazy cat"])
    deltas = _check_stream(det, ids, "The quick brown fox jumps over the lazy dog")
    assert det.stop_matched is None
    assert deltas[7] == "" and deltas[8] == " lazy dog"  # " lazy" held until " dog" broke the match


def test_partial_match_is_emitted_by_finish(smol):
    ids = encode(smol, "The quick brown fox jumps over the laz")
    det = IncrementalDetokenizer(smol, stop=[" lazy"])
    deltas = _check_stream(det, ids, "The quick brown fox jumps over the laz")
    assert deltas[-1] == " laz" and det.stop_matched is None


def test_multibyte_stop_string(smol):
    ids = encode(smol, "abc 中文 😀 tail")
    det = IncrementalDetokenizer(smol, stop=["😀"])
    deltas = _check_stream(det, ids, "abc 中文 ")
    assert det.stop_matched == "😀" and not any("\ufffd" in d for d in deltas)


def test_stop_string_in_prompt_context_is_not_matched(smol):
    tail = encode(smol, "say STOP")
    det = IncrementalDetokenizer(smol, tail, stop=["STOP"])
    _check_stream(det, encode(smol, " fine"), " fine")
    assert det.stop_matched is None


def test_empty_stop_string_is_refused(smol):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(smol, stop=[""])


# ---------------------------------------------------------------------- properties

ALPHABET = st.sampled_from(list("abcdefgh xyz.,!?\n'") + list("éüßñ中文字日本😀👍🇫🇷€∑") + ["\u200d", "\u0301"])
HYPO = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@HYPO
@given(text=st.text(ALPHABET, min_size=1, max_size=40), chunk=st.integers(1, 4))
def test_property_stream_equals_decode(smol, sp, text, chunk):
    for t in (smol, sp):
        ids = encode(t, text)
        deltas = stream(IncrementalDetokenizer(t), ids, chunk)
        assert "".join(deltas) == t.decode(ids, skip_special_tokens=True)
        if "\ufffd" not in t.decode(ids):
            assert not any("\ufffd" in d for d in deltas)


def _expected_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The reference: the stop string whose first occurrence ends first (then starts first)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, s = min(found)
    return text[: end if include else start], s


@HYPO
@given(
    text=st.text(ALPHABET, min_size=1, max_size=40),
    cuts=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=3),
    extra=st.text(ALPHABET, min_size=1, max_size=3),
    include=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_property_stop_strings(smol, text, cuts, extra, include, chunk):
    ids = encode(smol, text)
    full = smol.decode(ids)
    stops = [full[a : a + n] for a, n in cuts if full[a : a + n]] + [extra]
    expected, stop = _expected_stop(full, stops, include)
    det = IncrementalDetokenizer(smol, stop=stops, include_stop_str_in_output=include)
    _check_stream(det, ids, expected, chunk)
    assert det.stop_matched == stop


def test_logprobs_are_decoded_and_cut_with_their_tokens_at_a_stop_string(smol, sp):
    """The detokenizer decodes each token's log probabilities (texts and bytes, the top tokens'
    too) and keeps exactly those of the tokens it consumed: the ones after a stop string go.
    A token holding part of an emoji (byte-level BPE, SentencePiece byte fallback) has the text
    U+FFFD but its own bytes, so the bytes concatenate to the UTF-8 of the text; a SentencePiece
    token keeps the space of its "▁"."""
    from pathlib import Path

    from services.detokenizer.service import DetokenizerService
    from shared.config import Settings
    from shared.messages import DetokenizeParams, DetokNewRequest, DetokStep, SampleLogprobs, TokenUpdate
    from shared.model_source import ModelInfo

    for tokenizer, text in ((smol, " café 😀 done. STOP more text"), (sp, "Hello world STOP again"),
                            (sp, "wörld 😀 STOP x")):
        info = ModelInfo(path=Path("/x"), name="m", max_model_len=64, eos_token_ids=(EOS,), vocab_size=49152)
        service = DetokenizerService(Settings(), info, tokenizer=tokenizer)
        ids = encode(tokenizer, text)
        lps = [SampleLogprobs(logprob=-0.5 * i, rank=i + 1, top_token_ids=[t, EOS], top_logprobs=[-0.25, -9.0])
               for i, t in enumerate(ids)]
        new = DetokNewRequest(request_id="r", gateway_id="g", prompt_tail_ids=[], num_prompt_tokens=3,
                              params=DetokenizeParams(stop=["STOP"]))
        out = service.process(DetokStep(new_requests=[new], updates=[TokenUpdate(request_id="r", new_token_ids=ids,
                                                                                   logprobs=lps)]))
        (delta,) = out.by_gateway["g"]
        assert delta.finished and delta.stop_reason == "STOP" and out.aborted == ["r"]
        assert 0 < len(delta.token_ids) < len(ids)
        assert [lp.sampled.token_id for lp in delta.logprobs] == delta.token_ids == ids[:len(delta.token_ids)]
        assert [(lp.sampled.logprob, lp.sampled.rank) for lp in delta.logprobs] == [
            (-0.5 * i, i + 1) for i in range(len(delta.token_ids))]
        consumed_text = tokenizer.decode(delta.token_ids)
        assert consumed_text.endswith("STOP") and delta.text == consumed_text[: -len("STOP")]
        for lp in delta.logprobs:
            if tokenizer is smol:
                piece = tokenizer.convert_ids_to_tokens(lp.sampled.token_id)
                assert lp.sampled.token == tokenizer.convert_tokens_to_string([piece])
            assert [(t.token_id, t.logprob, t.rank) for t in lp.top] == [(lp.sampled.token_id, -0.25, 1), (EOS, -9.0, 2)]
            assert lp.top[1].token == tokenizer.convert_ids_to_tokens(EOS)
        if "😀" in text:  # byte tokens: the bytes of the parts of a character concatenate to it
            lead = b" " if tokenizer is sp else b""  # SentencePiece's "▁" of the first word
            assert b"".join(bytes(lp.sampled.bytes) for lp in delta.logprobs) == lead + consumed_text.encode()
            assert sum(lp.sampled.token == "\ufffd" for lp in delta.logprobs) >= 1  # a part of the emoji
        else:  # the space of a "▁" token is kept (decoding it alone strips it)
            assert "".join(lp.sampled.token for lp in delta.logprobs) == " " + consumed_text
            assert all(bytes(lp.sampled.bytes) == lp.sampled.token.encode() for lp in delta.logprobs)


def test_stop_strings_are_not_matched_before_min_tokens(smol):
    """As vLLM: a stop string in the text of the first ``min_tokens`` tokens is passed over
    (emitted), and a later one ends the request; a stop string ending in a later token still
    matches whole even if it started earlier."""
    ids = encode(smol, "a. b. c. d.")
    n = next(k for k in range(1, len(ids)) if smol.decode(ids[:k]).endswith("."))  # tokens up to the first "."
    det = IncrementalDetokenizer(smol, stop=["."], min_tokens=n)
    assert "".join(stream(det, ids)) == smol.decode(ids)[: smol.decode(ids).index(".", len(smol.decode(ids[:n])))]
    assert det.stop_matched == "."
    det = IncrementalDetokenizer(smol, stop=["."], min_tokens=len(ids))
    assert "".join(stream(det, ids)) == "a. b. c. d." and det.stop_matched is None
    ids = encode(smol, "x stop here")
    det = IncrementalDetokenizer(smol, stop=["stop here"], min_tokens=2)  # starts in token 2, ends after it
    assert "".join(stream(det, ids)) == "x " and det.stop_matched == "stop here"
