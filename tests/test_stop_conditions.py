"""Stop conditions through the engine: a stop string trims the text and ends with "stop" (the text streamed
never shows it), stop token ids and max_tokens end where they say, and eos ends a reply unless ignore_eos.
engine/front/output_processor.py decides them."""

import json
import shutil

from engine import SamplingParams


def first_stop_string(tokenizer, token_ids, start=3):
    """A printable two-character string spanning a token boundary in the greedy output, if any."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    for k in range(start, len(pieces) - 1):
        a, b = pieces[k], pieces[k + 1]
        if a and b and a[-1].isprintable() and b[0].isprintable() and "\ufffd" not in a + b:
            return a[-1] + b[0]
    return None


def test_stop_string_is_trimmed_and_finishes_with_stop(tiny_qwen2, make_llm):
    llm = make_llm(tiny_qwen2)
    prompt = "Hello world, this is a test"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)[0]
    stop = first_stop_string(llm.tokenizer, full["token_ids"])
    assert stop is not None, f"no usable stop string in {full['text']!r}"
    cut = full["text"].index(stop)

    rid = llm.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[stop, "\x00never"])
    )
    increments, last = [], None
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.request_id == rid
            increments.append(out.new_text)
            last = out
    assert last.finished and last.finish_reason == "stop"
    assert "".join(increments) == full["text"][:cut]
    assert all(stop not in inc for inc in increments)
    assert last.token_ids == full["token_ids"][: len(last.token_ids)] and len(last.token_ids) < 48

    again = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=stop), use_tqdm=False
    )[0]
    assert (again["text"], again["finish_reason"]) == (full["text"][:cut], "stop")


def test_stop_token_ids_and_max_tokens(tiny_qwen2, make_llm, random_prompt):
    llm = make_llm(tiny_qwen2)
    prompt = random_prompt(7, 80)
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert full["finish_reason"] == "length" and len(full["token_ids"]) == 40
    stop_token = full["token_ids"][5]
    first = full["token_ids"].index(stop_token)
    stopped = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == full["token_ids"][: first + 1]
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert (short["token_ids"], short["finish_reason"]) == (full["token_ids"][:3], "length")
    one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert len(one["token_ids"]) == 1 and one["finish_reason"] in ("length", "stop")


def test_eos_stops_unless_ignore_eos(tiny_qwen2, make_llm, random_prompt, tmp_path):
    prompt = random_prompt(7, 90)
    reference = make_llm(tiny_qwen2).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )[0]["token_ids"]
    # A copy of the model whose generation config names a token the greedy output reaches as eos.
    eos = reference[6]
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen2, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos], "pad_token_id": 0}))
    llm = make_llm(folder)
    assert {2, eos} <= llm.eos_token_ids
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == reference[: reference.index(eos) + 1]
    ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert (ignored["token_ids"], ignored["finish_reason"]) == (reference, "length")
