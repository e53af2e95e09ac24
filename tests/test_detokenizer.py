"""Incremental detokenisation with a byte-level BPE that splits multi-byte characters across tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.core.sequence import Sequence
from engine.front.detokenizer import Detokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 42",
    "你好，世界。今天天气很好。",
    "Paged attention 把键和值存进块里。",
    "emoji 😀🎉 and flags 🇯🇵, family 👨‍👩‍👧 done",
    "naïve café, Ωmega ≠ ∞ — “quotes”",
    "🙂",
    "天",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen2"])


def stream(tokenizer, ids, prompt=(5, 6, 7), final_flag=True):
    """Feed `ids` one at a time; return the increments and the sequence."""
    detok = Detokenizer(tokenizer)
    seq = Sequence(list(prompt), SamplingParams())
    increments = []
    for k, token in enumerate(ids):
        seq.token_ids.append(token)
        inc = detok.update(seq, final=final_flag and k == len(ids) - 1)
        increments.append(inc)
    return increments, seq


def test_the_tiny_tokenizer_splits_characters_across_tokens(tokenizer):
    # Otherwise the tests below would not exercise the hard path.
    for text in ("你好，世界", "😀🎉"):
        ids = tokenizer.encode(text)
        assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_increments_add_up_to_the_full_decode_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    increments, seq = stream(tokenizer, ids)
    assert "".join(increments) == seq.output_text == text
    assert not any("\ufffd" in inc for inc in increments)
    # Without the final flag, valid text comes out completely anyway.
    increments, seq = stream(tokenizer, ids, final_flag=False)
    assert "".join(increments) == text and not any("\ufffd" in inc for inc in increments)


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(
            ["the", " fox", " ", "\n", "你", "好", "，", "世界", "😀", "🎉", "é", "Ω", "42", "👨‍👩‍👧", "。"]
        ),
        min_size=1,
        max_size=12,
    )
)
def test_any_mixture_of_scripts_streams_cleanly(tokenizer, pieces):
    text = "".join(pieces)
    ids = tokenizer.encode(text)
    increments, seq = stream(tokenizer, ids)
    assert "".join(increments) == text
    assert not any("\ufffd" in inc for inc in increments)


def test_special_tokens_are_skipped_and_prompt_is_not_echoed(tokenizer):
    prompt = tokenizer.encode("你好")
    ids = tokenizer.encode("Hello 世界") + [tokenizer.eos_token_id]
    increments, seq = stream(tokenizer, ids, prompt=prompt)
    assert "".join(increments) == "Hello 世界"


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(3, 319), min_size=1, max_size=30))
def test_arbitrary_token_streams_add_up_to_the_full_decode(tokenizer, ids):
    # Random byte tokens make invalid UTF-8; whatever the text is, the stream must agree with it.
    increments, seq = stream(tokenizer, ids)
    assert "".join(increments) == seq.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_character_completed_after_a_long_invalid_run_is_not_emitted_broken(tokenizer):
    # Byte 0xE0 six times (invalid), then 0xE0 0xA1 0xA1 (U+0861): the hold limit is reached while
    # that character is half there; what is let out must leave its bytes to the next step.
    ids = [159] * 6 + [159, 97, 97]
    assert [tokenizer.convert_ids_to_tokens(i) for i in (159, 97)] == ["à", "¡"]  # bytes E0 and A1
    increments, seq = stream(tokenizer, ids)
    assert "".join(increments) == tokenizer.decode(ids) and tokenizer.decode(ids).endswith("\u0861")


def test_engine_streams_the_same_text_as_decoding_its_tokens(tiny_models, make_llm, random_prompt):
    llm = make_llm(tiny_models["qwen3"])
    ids = [
        llm.add_request(random_prompt(5 + i, 1000 + i), SamplingParams(temperature=1.0, max_tokens=40, seed=i))
        for i in range(4)
    ]
    texts = {rid: [] for rid in ids}
    final = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            texts[out.request_id].append(out.new_text)
            if out.finished:
                final[out.request_id] = out.token_ids
    for rid in ids:
        assert "".join(texts[rid]) == llm.tokenizer.decode(final[rid], skip_special_tokens=True)


def test_an_invalid_byte_run_is_held_back_only_up_to_the_cap(tokenizer):
    """A model that samples stray bytes (0xE0 never completes a character here) must not stall its
    stream: past MAX_HELD_TOKENS the text goes out, broken characters and all, as the full decode has it."""
    from engine.front.detokenizer import MAX_HELD_TOKENS

    ids = [159] * 24  # byte E0 again and again: invalid UTF-8 for as long as it lasts
    detok = Detokenizer(tokenizer)
    seq = Sequence([5, 6, 7], SamplingParams())
    held = []
    for token in ids:
        seq.token_ids.append(token)
        detok.update(seq)  # never final: the stream is still going
        held.append(len(seq.token_ids) - seq.num_prompt_tokens - seq.read_offset)
    assert max(held) <= MAX_HELD_TOKENS, held
    assert seq.output_text and tokenizer.decode(ids).startswith(seq.output_text)
