"""Hypothesis strategies for OpenAI request bodies as clients send them, right and wrong: each field of the request
models (entrypoints/openai/protocol.py) with a value of its own type, in its range or just outside it; messages,
tools, structured outputs and prompts; any JSON at all; and `bodies`, which draws a body and may make one mistake
in it. tests/test_fuzz_server.py sends them to a real server."""

from hypothesis import strategies as st

MODEL = "fuzz"  # the served model's name
VOCAB = 320  # tests/conftest.py's tokenizer
MAX_TOKENS = 8  # generated bodies may ask for hundreds; a fuzz case needs only a few to exercise the reply

# Any JSON value, for a field of the wrong type. Floats include NaN and the infinities, which json.dumps
# writes as JavaScript does; integers go far past 64 bits.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**80),
    st.floats(),
    st.text(max_size=8),
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
# Text as users and clients send it: any code point but a lone surrogate (see `any_text`), empty or not
text = st.text(max_size=40)
short_text = st.text(min_size=1, max_size=12)
any_text = text | st.text(st.characters(exclude_categories=()), max_size=10)  # lone surrogates: never valid JSON
token_ids = st.integers(0, VOCAB - 1)


def within(low: float, high: float) -> st.SearchStrategy:
    """A number in [low, high], its ends included, as a float or an int."""
    return st.floats(low, high) | st.sampled_from([low, high]) | st.integers(int(low), int(high))


# JSON schemas, small enough to compile quickly: of the kinds structured outputs meet, and some nonsense
json_schemas = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "nonsense"])},
        optional={
            "enum": st.lists(scalars, max_size=3),
            "pattern": short_text,
            "minLength": st.integers(-1, 5),
            "maxLength": st.integers(-1, 5),
            "minimum": within(-3, 3),
            "format": st.sampled_from(["date", "email", "x"]),
        },
    ),
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object"), "properties": st.dictionaries(short_text, inner, max_size=3)},
            optional={"required": st.lists(short_text, max_size=2), "additionalProperties": st.booleans() | inner},
        ),
        st.fixed_dictionaries(
            {"type": st.just("array"), "items": inner},
            optional={"minItems": st.integers(-1, 3), "maxItems": st.integers(-1, 3)},
        ),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.dictionaries(short_text, junk, max_size=3),
    ),
    max_leaves=6,
)
regexes = (
    st.sampled_from(
        [
            r"[a-z]+",
            r"\d{1,3}",
            r"(yes|no)",
            r"a*",
            r"(",
            r"[",
            r"a{5,2}",
            r"\\",
            r".*?$",
            r"",
            r"(?=a)b",
            r"\1",
            r"[^\x00-\U0010ffff]",
        ]
    )
    | short_text
)
grammars = (
    st.sampled_from(
        ['start: "yes" | "no"', 'root ::= "a" root | "b"', "start: x", "::=", "", "start: start", "start: /[0-9]+/"]
    )
    | short_text
)
structured_outputs = st.one_of(
    st.fixed_dictionaries({"json": json_schemas | text}),
    st.fixed_dictionaries({"regex": regexes}),
    st.fixed_dictionaries({"choice": st.lists(text, max_size=3)}),
    st.fixed_dictionaries({"grammar": grammars}),
    st.fixed_dictionaries({"json_object": st.booleans()}),
    st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "other"]), junk, max_size=3),
)
response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    st.fixed_dictionaries(
        {
            "type": st.just("json_schema"),
            "json_schema": st.fixed_dictionaries(
                {"name": short_text, "schema": json_schemas}, optional={"strict": st.booleans()}
            ),
        }
    ),
    st.dictionaries(st.sampled_from(["type", "json_schema", "schema"]), junk, max_size=2),
)
tools = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": short_text}, optional={"description": text, "parameters": json_schemas}
                ),
            }
        ),
        st.dictionaries(st.sampled_from(["type", "function", "name"]), junk, max_size=3),
    ),
    max_size=3,
)
tool_choices = (
    st.sampled_from(["none", "auto", "required", "any"])
    | st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": short_text})})
    | st.dictionaries(short_text, junk, max_size=2)
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": short_text,
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": short_text, "arguments": text | st.dictionaries(short_text, scalars)}
            ),
        }
    )
    | st.dictionaries(short_text, junk, max_size=2),
    min_size=1,
    max_size=2,
)
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": text})
    | st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio"])}, optional={"image_url": junk}),
    max_size=3,
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user"]), "content": text | content_parts},
        optional={"name": short_text},
    ),
    st.fixed_dictionaries(
        {"role": st.just("assistant")},
        optional={"content": text | st.none(), "tool_calls": tool_calls, "reasoning_content": text},
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": text}, optional={"tool_call_id": short_text}),
)

# Each field of the request models (protocol.py) with a value of its own type, in its range or (now and
# then) just outside it; vLLM's guided_* names, and fields that change nothing here.
COMMON = {
    "model": st.just(MODEL) | st.none() | short_text,
    "temperature": within(0, 2),
    "top_p": within(1e-9, 1),
    "stop": short_text | st.lists(text, max_size=3),
    "seed": st.integers(-(2**63), 2**64 - 1) | st.integers(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1) | st.integers(),
    "top_k": st.integers(-2, VOCAB + 3) | st.integers(),
    "min_p": within(0, 1),
    "repetition_penalty": within(1e-3, 3),
    "presence_penalty": within(-2, 2),
    "frequency_penalty": within(-2, 2),
    "logit_bias": st.dictionaries(st.integers(-1, VOCAB + 2).map(str), within(-100, 100) | st.floats(), max_size=4),
    "priority": st.integers(-5, 5) | st.integers(),
    "response_format": response_formats,
    "structured_outputs": structured_outputs,
    "guided_json": json_schemas,
    "guided_regex": regexes,
    "guided_choice": st.lists(short_text, max_size=3),
    "guided_grammar": grammars,
    "user": text,
    "metadata": junk,
}
# Fields Pagoda refuses by name (protocol.REFUSED_FIELDS), for the mistaken bodies
REFUSED = st.sampled_from(
    [
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
        "best_of",
        "use_beam_search",
    ]
)
CHAT = {
    **COMMON,
    "max_tokens": st.integers(1, MAX_TOKENS),
    "max_completion_tokens": st.integers(1, MAX_TOKENS),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "tools": tools,
    "tool_choice": tool_choices,
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "tools", "messages", "x"]) | short_text, junk, max_size=3
    ),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high"]),
    # Ollama's names, as Open WebUI sends them
    "repeat_penalty": st.floats(0.5, 2.0),
    "num_predict": st.integers(-1, MAX_TOKENS),
    "format": st.just("json") | st.just({"type": "object"}),
    "think": st.booleans() | st.sampled_from(["low", "medium", "high"]),
    "num_ctx": st.integers(1, 1 << 20),
}
COMPLETION = {
    **COMMON,
    "max_tokens": st.integers(0, MAX_TOKENS),
    "echo": st.booleans(),
    "suffix": st.none() | text,
    "logprobs": st.integers(0, 20) | st.none(),
}


@st.composite
def bodies(draw, required: dict, fields: dict, mutate: bool) -> dict:
    """A request body: its required fields and a few of the others, each drawn by itself, so that most
    bodies get past validation into the engine. `mutate`: then one change a client might get wrong: a
    field of another type (or a lone surrogate), a required one left out, or a field nobody knows (or one
    refused by name)."""
    body = {name: draw(value) for name, value in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name])
    if mutate:
        how = draw(st.sampled_from(["junk", "surrogate", "leave out", "unknown"]))
        name = draw(st.sampled_from(sorted({*required, *fields})))
        if how == "junk":
            body[name] = draw(junk)
        elif how == "surrogate":
            body[name] = draw(any_text)
        elif how == "leave out":
            body.pop(draw(st.sampled_from(sorted(required))), None)
        else:
            body[draw(any_text | REFUSED)] = draw(junk)
    return body


messages = st.lists(message, min_size=1, max_size=4)
prompts = (
    short_text
    | st.lists(token_ids, min_size=1, max_size=8)
    | st.lists(short_text, min_size=1, max_size=2)
    | st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1, max_size=2)
    | st.just("")
    | st.just([])
)
