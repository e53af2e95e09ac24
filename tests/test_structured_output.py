"""Constrained decoding (SamplingParams.structured_outputs): every reply matches its constraint, free rows
beside constrained ones are unchanged, and the prefix cache, preemption and async scheduling still hold."""

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.loader.bundled import bundled_gguf_path
from engine.sample.sampler import apply_grammar_mask, unpack_bitmask

# Objects, enums, integer ranges, arrays and additionalProperties: false: far beyond what a 135M model
# follows unaided, so every valid reply is the constraint's doing.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}


def constrained(**constraint) -> StructuredOutputsParams:
    return StructuredOutputsParams(**constraint)


@pytest.fixture(scope="module")
def smollm2():
    return LLM(str(bundled_gguf_path()), num_kvcache_blocks=256, max_model_len=1024)


@pytest.mark.timeout(600)
def test_every_sampled_reply_of_the_bundled_model_validates_against_the_schema(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "Describe a person."}])
    params = [
        SamplingParams(temperature=0.8, seed=seed, max_tokens=160, structured_outputs=constrained(json=PERSON))
        for seed in range(12)
    ]
    outs = smollm2.generate([prompt] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PERSON)
    assert len({o["text"] for o in outs}) > 6  # sampled, not one reply repeated


def test_unconstrained_the_bundled_model_does_not_follow_the_schema(smollm2):
    """The control for the test above: without the mask, the same request is not valid JSON of the schema."""
    prompt = smollm2.encode_chat([{"role": "user", "content": "Describe a person."}])
    out = smollm2.generate([prompt], SamplingParams(temperature=0, max_tokens=160), use_tqdm=False)[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(out["text"]), PERSON)


def test_regex_choice_json_object_and_grammar(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "Give me a phone number."}])
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    cases = [
        (constrained(regex=r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
        (constrained(choice=["alpha", "beta gamma"]), lambda t: t in ("alpha", "beta gamma")),
        # any object may go on for ever: one cut off by max_tokens is checked as far as it goes
        (constrained(json_object=True), lambda t: t.startswith("{")),
        (constrained(grammar=lark), lambda t: re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", t)),
        (constrained(grammar=gbnf), lambda t: t in ("yes", "no", "maybe")),
    ]
    params = [SamplingParams(temperature=0.7, seed=3, max_tokens=200, structured_outputs=c) for c, _ in cases]
    outs = smollm2.generate([prompt] * len(cases), params, use_tqdm=False)
    for (constraint, ok), out in zip(cases, outs):
        assert ok(out["text"]), out["text"]
        if constraint.json_object and out["finish_reason"] == "length":
            continue
        assert out["finish_reason"] == "stop"
        if constraint.json_object:
            assert isinstance(json.loads(out["text"]), dict)


def test_free_rows_beside_constrained_ones_are_unchanged(tiny_qwen2, random_prompt, make_llm):
    prompts = [random_prompt(12 + i, i) for i in range(4)]
    free = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2
    alone = make_llm(tiny_qwen2).generate(prompts[:2], free, use_tqdm=False)
    mixed = make_llm(tiny_qwen2).generate(
        prompts,
        free
        + [
            SamplingParams(temperature=0, max_tokens=16, structured_outputs=constrained(regex="[a-z ]+x")),
            SamplingParams(
                temperature=0.9, seed=1, max_tokens=16, structured_outputs=constrained(choice=["fox", "dog"])
            ),
        ],
        use_tqdm=False,
    )
    assert [o["token_ids"] for o in mixed[:2]] == [o["token_ids"] for o in alone]
    assert re.fullmatch("[a-z ]+x", mixed[2]["text"]) or mixed[2]["finish_reason"] == "length"
    assert mixed[3]["text"] in ("fox", "dog")


def test_a_constrained_greedy_token_is_the_masked_argmax(tiny_qwen2, random_prompt, make_llm, hf_model):
    """The sampler drops exactly the forbidden tokens: with a choice of words, the first greedy token is the
    one transformers' logits rank highest among the tokens that start one of the words."""
    llm = make_llm(tiny_qwen2)
    tok = llm.tokenizer
    words = ["quick brown", "lazy dog", "paged attention"]
    starts = [t for t in range(len(tok)) if (text := tok.decode([t])) and any(w.startswith(text) for w in words)]
    assert len(starts) > 3
    for seed in range(4):
        prompt = random_prompt(10, 50 + seed)
        with torch.no_grad():
            logits = hf_model(tiny_qwen2)(torch.tensor([prompt])).logits[0, -1]
        expected = starts[int(logits[starts].argmax())]
        out = llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=constrained(choice=words)),
            use_tqdm=False,
        )[0]
        assert out["token_ids"][0] == expected
        assert out["text"] in words


def test_constrained_requests_share_the_prefix_cache(tiny_qwen2, random_prompt, make_llm):
    llm = make_llm(tiny_qwen2)
    prompt = random_prompt(40, 9)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    again = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=constrained(regex="[0-9]{4}")),
        use_tqdm=False,
    )[0]
    assert again["num_cached_tokens"] == 32  # two full 16-token blocks of the same prompt
    assert re.fullmatch("[0-9]{4}", again["text"])
    after = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert after["token_ids"] == free["token_ids"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_and_async_constrained_requests_still_match(tiny_qwen2, random_prompt, make_llm, async_scheduling):
    """Few KV blocks force preemption (recomputed requests must not feed their tokens to the matcher again);
    async scheduling must read a constrained request's token back before masking its next one."""
    llm = make_llm(tiny_qwen2, num_kvcache_blocks=12, async_scheduling=async_scheduling)
    prompts = [random_prompt(20, 30 + i) for i in range(6)]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=64, structured_outputs=constrained(regex="(ab|cd){12,30}"))
        for i in range(6)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for out in outs:
        assert re.fullmatch("(ab|cd){12,30}", out["text"]), out
        assert out["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "constraint, named",
    [
        (dict(json={"type": "objekt"}), "objekt"),
        (dict(regex="a(b"), "unclosed group"),
        (dict(grammar='start: "a" undefined_rule'), "undefined_rule"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json={"$ref": "#"}), "no reply can follow this constraint from its first token"),  # it failed once queued
    ],
)
def test_an_invalid_constraint_is_refused_with_its_reason_and_changes_nothing(tiny_qwen2, make_llm, constraint, named):
    llm = make_llm(tiny_qwen2)
    with pytest.raises(ValueError, match=re.escape(named)):
        llm.add_request([5, 6, 7], SamplingParams(structured_outputs=constrained(**constraint)))
    assert not llm.has_unfinished_requests() and not llm.requests


def test_structured_outputs_params_want_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .*got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="choice must be a list of non-empty strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_the_bitmask_forbids_exactly_its_cleared_bits():
    logits = torch.randn(3, 70)
    allowed = {1: [0, 31, 32, 69], 2: [5]}
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for i, tokens in enumerate(allowed.values()):
        for t in tokens:
            bitmask[i, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    unpacked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :70].astype(bool)
    assert torch.equal(unpack_bitmask(bitmask, 70), torch.from_numpy(unpacked))  # the device's way, the CPU's
    out = apply_grammar_mask(logits, torch.tensor([1, 2]), unpack_bitmask(bitmask, 70))
    every = apply_grammar_mask(logits[1:], torch.tensor([0, 1]), unpack_bitmask(bitmask, 70))
    assert torch.equal(every, out[1:])
    assert torch.equal(out[0], logits[0])  # an unconstrained row
    for row, tokens in allowed.items():
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert finite == tokens
        assert torch.equal(out[row, tokens], logits[row, tokens])
    assert torch.isfinite(logits).all()  # out of place: the raw logits stay for logprobs


def chained_rules(n: int) -> str:
    """A grammar of n rules, each naming the next: 100 KB of text at 4,000 rules."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n}: "z"\n'


@pytest.mark.timeout(600)
def test_a_long_chain_of_rules_compiles_and_constrains_without_crashing_the_process(smollm2):
    """4,000 chained rules overflowed the stack of the thread that compiled them: the server died of a segfault."""
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=constrained(grammar=chained_rules(4000)))
    out = smollm2.generate(["Say something."], params, use_tqdm=False)[0]
    assert re.fullmatch(r"a*(b|z)", out["text"]) and out["finish_reason"] == "stop", out


def test_a_grammar_with_too_many_rules_is_refused_saying_the_limit(smollm2):
    from engine.sample.structured_output import MAX_GRAMMAR_RULES

    params = SamplingParams(structured_outputs=constrained(grammar=chained_rules(MAX_GRAMMAR_RULES)))
    with pytest.raises(ValueError, match=r"the grammar has 10,002 rules, more than the 10,000 Pagoda compiles"):
        smollm2.add_request("Say something.", params)
    assert not smollm2.has_unfinished_requests()


def test_llguidance_panics_are_said_plainly():
    from engine.sample.structured_output import compile_error_message

    panic = (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>\n"
        "   1: <unknown>"
    )
    assert compile_error_message(panic) == (
        "the constraint is too large: it compiles to more than 65,000 grammar "
        "symbols, llguidance's limit; give fewer choices, properties or rules"
    )
    other = compile_error_message("panic: index out of bounds\n<backtrace>\n   0: <unknown>")
    assert other == "the constraint could not be compiled (llguidance failed: index out of bounds)"
    assert compile_error_message("1(7): unknown name: 'foo'\n  1 | start: foo") == (
        "the constraint does not compile: 1(7): unknown name: 'foo'\n  1 | start: foo"
    )
    assert len(compile_error_message("x" * 1_000_000)) < 1100  # a whole grammar once went into one message


def test_a_constraint_compiles_once_and_each_request_gets_its_own_matcher(tiny_qwen2, make_llm):
    """The cache kept the grammar's text and built the matcher (the slow part) again for every request."""
    llm = make_llm(tiny_qwen2)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]}
    params = [
        SamplingParams(temperature=0.9, seed=seed, max_tokens=40, structured_outputs=constrained(json=schema))
        for seed in (3, 4)
    ]
    outs = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    for out in outs:  # each matcher followed its own reply: a shared one would have refused the second's tokens
        jsonschema.validate(json.loads(out["text"]), schema)
    assert llm.structured_outputs.compiles == 1


@pytest.mark.timeout(300)
def test_a_constraint_compiling_does_not_stop_other_streams(tiny_qwen2, monkeypatch):
    """EngineThread.submit compiled under the lock every step waits on: a 4,000-property schema (seconds to
    compile) stalled every stream of the server. Here the compile is held until another stream has ended."""
    import threading

    from engine import EngineThread

    served = EngineThread.load(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64)
    try:
        compiler = served.engine.structured_outputs
        compiling, release, held_to_the_end = threading.Event(), threading.Event(), threading.Event()
        compile_now = compiler._compile

        def held_compile(params):
            compiling.set()
            if not release.wait(60):
                held_to_the_end.set()  # never released: the other stream could not end meanwhile
            return compile_now(params)

        monkeypatch.setattr(compiler, "_compile", held_compile)
        constrained_out = []
        json_request = SamplingParams(max_tokens=20, structured_outputs=constrained(json_object=True))
        submitter = threading.Thread(
            target=lambda: constrained_out.extend(served.submit([5, 6, 7], json_request)), daemon=True
        )
        submitter.start()
        assert compiling.wait(60)
        free = list(served.submit([8, 9, 10], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
        assert free[-1].finished and len(free[-1].token_ids) == 12
        assert not held_to_the_end.is_set(), "the stream could only end once the compile had given up waiting"
        release.set()
        submitter.join(120)
        assert constrained_out and constrained_out[-1].finished
    finally:
        release.set()
        served.shutdown()


def test_a_constraint_that_fails_mid_reply_ends_in_an_error_not_a_stop(tiny_qwen2, make_llm):
    """llguidance gave up mid-reply (a limit of its parser) or the constraint could not go on: the reply ended with
    finish_reason "stop" and broke the constraint ("o", "{"), and the log got the whole grammar on one line."""
    llm = make_llm(tiny_qwen2)
    failing = {
        "choice": constrained(choice=[f"option number {i}" for i in range(2010)]),  # a parser row over 2,000 items
        "grammar": constrained(grammar='start: "a" start'),  # right recursion past the parser's 50,000 items
    }
    for name, constraint in failing.items():
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, structured_outputs=constraint), use_tqdm=False)
        out = out[0]
        assert out["finish_reason"] == "error", (name, out)
        assert out["error"].startswith("the reply could not follow its constraint: ") and "<state>" not in out["error"]
        assert len(out["error"]) < 1100
    ok = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, structured_outputs=constrained(choice=["yes", "no"])))
    assert ok[0]["finish_reason"] == "stop" and ok[0]["error"] is None


def test_through_the_engine_thread_a_failed_constraint_raises_what_went_wrong(tiny_qwen2):
    from engine import EngineThread, RequestFailed

    served = EngineThread.load(str(tiny_qwen2), dtype="float32", num_kvcache_blocks=64)
    try:
        params = SamplingParams(max_tokens=30, structured_outputs=constrained(grammar='start: "a" start'))
        with pytest.raises(RequestFailed, match="the reply could not follow its constraint: parser error"):
            list(served.submit([5, 6, 7], params))
    finally:
        served.shutdown()
