"""The chat's tools as the model sees them (app/chat_tools.py): the grammar that holds a call to its tool's schema
from `<tool_call>` on and leaves an answer free, checked token by token on the bundled model's vocabulary; the names
the model calls tools by; and a reply's calls and results as the model reads them again."""

import json
from types import SimpleNamespace

import pytest

from app.backend import BadSettings, LocalBackend
from app.chat_settings import ChatSettings
from app.chat_tools import ChatTool, ToolPrompt, call_grammar, chat_tools, chat_turns
from app.mcp_servers import ToolInfo
from app.store_records import Message

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = (
    ChatTool("calc", "add", "add", "Add.", ADD),
    ChatTool("clock", "now", "now", "The time.", {"type": "object", "properties": {}}),
)


@pytest.fixture(scope="module")
def accepts():
    """accepts(mode, text): whether a reply in `mode` may be `text` (every token taken, and the grammar may end)."""
    import llguidance
    import llguidance.hf

    from engine.loader.bundled import bundled_gguf_path
    from engine.loader.gguf import GGUFCheckpoint

    tokenizer = GGUFCheckpoint.open(bundled_gguf_path()).tokenizer()
    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])

    def check(mode: str, text: str) -> bool:
        grammar = llguidance.grammar_from("lark", call_grammar(TOOLS, mode))
        matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
        taken = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return taken and matcher.is_accepting()

    return check


def hermes(name: str, arguments: dict, separators=(", ", ": ")) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, separators=separators)
    return f"<tool_call>\n{body}\n</tool_call>"


def test_an_answer_is_free_and_a_call_is_held_to_its_tools_schema(accepts):
    assert accepts("auto", "Use a < b, and <b>bold</b> <tool is fine.")
    assert accepts("auto", "Adding. " + hermes("add", {"a": 1, "b": 2}))
    assert accepts("auto", hermes("now", {}))
    assert not accepts("auto", hermes("sub", {"a": 1, "b": 2}))  # no such tool
    assert not accepts("auto", hermes("add", {"a": 1}))  # b is required
    assert not accepts("auto", hermes("add", {"a": 1, "b": 2, "c": 3}))  # nothing it does not declare
    assert not accepts("auto", hermes("add", {"a": "one", "b": 2}))
    assert not accepts("auto", hermes("add", {"a": 1, "b": 2}, separators=(",", ":")))  # json.dumps' spacing only
    assert not accepts("auto", hermes("now", {}) + "\n" + hermes("now", {}))  # one call a round


def test_before_each_answer_the_reply_must_be_a_call_and_the_last_round_cannot_make_one(accepts):
    assert accepts("first", hermes("add", {"a": 1, "b": 2}))
    assert not accepts("first", "The answer is 3.")
    assert not accepts("first", "Let me add. " + hermes("add", {"a": 1, "b": 2}))
    assert accepts("answer", "The answer is 3.")
    assert not accepts("answer", hermes("add", {"a": 1, "b": 2}))
    assert not accepts("answer", "Sure. <tool_call>")


def test_the_prompts_constraint_is_its_grammar():
    assert ToolPrompt(TOOLS, "first").constraint().grammar == call_grammar(TOOLS, "first")


def test_each_tool_is_called_by_its_name_or_with_its_server_where_two_servers_share_it():
    listed = [
        ToolInfo("files", "read", "Read a file.", {"type": "object"}),
        ToolInfo("web", "read", "Read a page.", {"type": "object"}),
        ToolInfo("web", "get.page", "Fetch.", {"type": "string"}),  # not an object: taken as one without parameters
        ToolInfo("web", "search", "Search.", {"type": "object"}),
    ]
    tools = chat_tools(listed, ["files/read", "web/read", "web/get.page"])
    assert [(t.key, t.name) for t in tools] == [
        ("files/read", "files_read"),
        ("web/read", "web_read"),
        ("web/get.page", "get_page"),
    ]
    assert tools[2].schema == {"type": "object"}


def test_two_tools_whose_names_clean_to_one_get_a_number():
    listed = [ToolInfo("web", "a.b", "", {"type": "object"}), ToolInfo("web", "a_b", "", {"type": "object"})]
    assert [t.name for t in chat_tools(listed, ["web/a.b", "web/a_b"])] == ["a_b", "a_b_2"]


def test_a_reply_that_called_tools_is_read_again_as_its_calls_and_their_outcomes():
    calls = [
        {"id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}', "status": "done", "result": "3"},
        {"id": "c2", "name": "add", "arguments": "{}", "status": "error", "result": "b is missing"},
        {"id": "c3", "name": "now", "arguments": "{}", "status": "denied"},
        {"id": "c4", "name": "now", "arguments": "{}", "status": "stopped"},
    ]
    stored = [
        Message(1, 1, "user", "Add 1 and 2.", {}, 0.0),
        Message(2, 1, "assistant", "Adding.", {"tool_calls": calls}, 0.0, 1),
        Message(3, 1, "assistant", "3.", {}, 0.0, 2),
    ]
    turns = chat_turns(stored)
    assert turns[1]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    assert [(t["role"], t.get("tool_call_id"), t["content"]) for t in turns[2:6]] == [
        ("tool", "c1", "3"),
        ("tool", "c2", "Error: b is missing"),
        ("tool", "c3", "The user did not allow this call."),
        ("tool", "c4", "The user stopped this call."),
    ]
    assert turns[6] == {"role": "assistant", "content": "3."}


class RecordingEngine:
    """Stands in for an EngineThread with a given chat template: keeps what each reply was encoded and held to."""

    max_model_len, device = 4096, "cpu"

    def __init__(self, template: str):
        self.tokenizer = SimpleNamespace(chat_template=template, decode=lambda ids: "")
        self.encoded, self.params = [], None

    def stats(self):
        return SimpleNamespace(quantization="none")

    def encode_chat(self, messages, **template_kwargs):
        self.encoded.append((messages, template_kwargs))
        return [1, 2, 3]

    def submit(self, ids, params):
        self.params = params
        return SimpleNamespace(request_id="r")


HERMES_TEMPLATE = "{% if tools %}<tools>{{ tools }}</tools> reply with <tool_call>{}</tool_call>{% endif %}"
LLAMA_TEMPLATE = "{% if tools %}Given the functions {{ tools }}, respond in JSON{% endif %}"  # calls of another form
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]


def test_a_template_with_hermes_tools_gets_them_as_its_own_and_the_call_is_held_to_the_schema():
    engine = RecordingEngine(HERMES_TEMPLATE)
    LocalBackend(engine, "qwen").submit(CHAT, ChatSettings(), ToolPrompt(TOOLS))
    messages, kwargs = engine.encoded[-1]
    assert kwargs["tools"] == [t.as_tool().as_openai() for t in TOOLS]
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "5"}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}  # templates write objects
    assert engine.params.structured_outputs.grammar == call_grammar(TOOLS, "auto")


def test_a_template_without_tools_gets_them_described_in_the_system_prompt_in_hermes_form():
    engine = RecordingEngine(PLAIN_TEMPLATE)
    LocalBackend(engine, "smollm").submit(CHAT, ChatSettings(), ToolPrompt(TOOLS, "first"))
    messages, kwargs = engine.encoded[-1]
    assert "tools" not in kwargs
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert '"name": "add"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    assert engine.params.structured_outputs.grammar == call_grammar(TOOLS, "first")


def test_a_template_with_calls_of_another_form_is_not_held_to_hermes():
    engine = RecordingEngine(LLAMA_TEMPLATE)
    LocalBackend(engine, "llama").submit(CHAT, ChatSettings(), ToolPrompt(TOOLS))
    assert engine.encoded[-1][1]["tools"] and engine.params.structured_outputs is None


def test_tools_and_json_output_cannot_both_be_on():
    engine = RecordingEngine(PLAIN_TEMPLATE)
    with pytest.raises(BadSettings, match="turn JSON output off"):
        LocalBackend(engine, "smollm").submit(CHAT, ChatSettings(json_output=True), ToolPrompt(TOOLS))
    assert engine.params is None


def test_a_chat_whose_tools_were_turned_off_still_reads_its_past_calls():
    engine = RecordingEngine(PLAIN_TEMPLATE)
    LocalBackend(engine, "smollm").submit(CHAT, ChatSettings())
    messages, _ = engine.encoded[-1]
    assert messages[3]["role"] == "user" and engine.params.structured_outputs is None


def test_a_conversation_is_counted_once_per_think_setting():
    """The file list counts each file at every chat opened: the count is kept, not tokenized again."""
    engine = RecordingEngine(PLAIN_TEMPLATE)
    backend = LocalBackend(engine, "smollm")
    file = [{"role": "system", "content": "<document>" + "words " * 1000 + "</document>"}]
    assert backend.prompt_tokens(file, ChatSettings()) == backend.prompt_tokens(file, ChatSettings()) == 3
    assert len(engine.encoded) == 1
    backend.prompt_tokens(file, ChatSettings(think=False))
    backend.prompt_tokens([{"role": "system", "content": "another"}], ChatSettings())
    assert len(engine.encoded) == 3
