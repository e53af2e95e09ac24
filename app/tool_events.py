"""The chat's tools, as the page's events: the servers of mcp.json and their tools in the Tools panel, which of them
the chat may call, the user's answer to a call (Allow once, Always for this tool, Deny), and the calls as the chat
shows them. ToolEvents is a base of PagodaUI (app/ui.py); the rounds of a reply that calls tools are
app/tool_rounds.py's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gradio as gr

from app.chat_settings import ChatSettings
from app.chat_tools import ToolPrompt, chat_tools, tool_key
from app.markdown_text import fenced, inert, markdown_escaped
from app.mcp_servers import CONFIG_NAME, McpError, McpHub, ToolInfo, load_mcp_config
from app.page import user_error
from app.sessions import Replies
from app.store import ConversationStore
from app.store_records import Message
from app.tool_rounds import ToolRounds

log = logging.getLogger("pagoda")
# How each state of a call reads in its block's title
CALL_STATES = {
    "asking": "waiting for you",
    "allowed": "allowed",
    "running": "running…",
    "done": "done",
    "error": "failed",
    "denied": "denied",
    "stopped": "stopped",
    "ended": "did not finish: Pagoda stopped first",
}


def open_mcp(config: Path, log_dir: Path, allow_commands: bool) -> tuple[McpHub | None, str]:
    """The hub of the servers `config` (an mcp.json) lists, and what is wrong with the file ("" when nothing is)."""
    try:
        servers = load_mcp_config(config)
    except McpError as e:
        return None, str(e)
    return McpHub(servers, log_dir, allow_commands=allow_commands), ""


class ToolEvents:
    """The Tools panel and the calls' links, a base of PagodaUI: PagodaUI sets what is declared here."""

    store: ConversationStore
    replies: Replies
    mcp: McpHub | None = None  # the servers of mcp.json (None: no file, or one that cannot be used)
    mcp_config: Path | None = None  # where mcp.json is
    mcp_problem: str = ""  # what is wrong with it
    mcp_commands_allowed: bool = True  # False on a page others can reach (--listen, --share): no stdio servers
    _tool_lists: dict[str, list[ToolInfo] | str] | None = None  # each started server's tools, or why it failed

    def close_tools(self) -> None:
        """Pagoda exits: every server stops."""
        if self.mcp is not None:
            self.mcp.close()

    # ---- the Tools panel ------------------------------------------------------------------------------------

    def list_tools(self, conversation_id=None):
        """The panel opened: each server started (when it is not running) and its tools listed. Returns the panel's
        status line, the chat's tool choices and its two settings."""
        lists = self._tool_lists = {}
        for name in self.mcp.servers if self.mcp is not None else {}:
            try:
                lists[name] = self.mcp.tools(name)
            except McpError as e:
                lists[name] = str(e)
        return self.tools_status(), *self.chat_tool_values(conversation_id)

    def reload_tools(self, conversation_id=None):
        """Reload mcp.json: the old servers stop, and the file's start as their tools are listed."""
        if any(task.rounds is not None for task in self.replies.running()):
            raise user_error("A reply is using tools: let it finish or press Stop, then Reload mcp.json.")
        self.close_tools()
        self.mcp, self.mcp_problem = None, ""
        if self.mcp_config is not None:
            self.mcp, self.mcp_problem = open_mcp(
                self.mcp_config, self.mcp_config.parent / "logs", self.mcp_commands_allowed
            )
        return self.list_tools(conversation_id)

    def tools_status(self) -> str:
        where = f"`{self.mcp_config}`" if self.mcp_config is not None else CONFIG_NAME
        if self.mcp_problem:
            return f"**{self.mcp_problem}**"
        if self.mcp is None or not self.mcp.servers:
            return (
                f"No MCP servers yet. Add them to {where} in the `mcpServers` shape Claude Desktop, LM Studio and "
                "Cursor use, then press Reload."
            )
        lines = [f"Servers from {where}. Each call asks you first, unless you chose Always for its tool."]
        for name, listed in (self._tool_lists or {}).items():
            if isinstance(listed, str):
                lines.append(f"- **{markdown_escaped(name)}**: {markdown_escaped(listed)}")
        if not self.mcp_commands_allowed:
            lines.append(
                "- Servers that run a command are off: this Pagoda is open to other computers (--listen or "
                "--share), and such a server would run programs on this one."
            )
        return "\n".join(lines)

    def chat_tool_values(self, conversation_id):
        """The panel for the chat: its tools among those listed (a tool it had on whose server is not listed yet
        stays a choice), when it calls them and its limit of rounds. Starts no server."""
        settings = self._settings(conversation_id)
        listed = [t for tools in (self._tool_lists or {}).values() if not isinstance(tools, str) for t in tools]
        choices = [(f"{t.server} › {t.name}", tool_key(t.server, t.name)) for t in listed]
        known = {key for _, key in choices}
        choices += [(key.replace("/", " › ", 1), key) for key in settings.tools if key not in known]
        always = [(key.replace("/", " › ", 1), key) for key in settings.tools_always]
        return (
            gr.update(choices=choices, value=list(settings.tools)),
            settings.tool_choice,
            settings.tool_rounds,
            gr.update(choices=always, value=[key for _, key in always], visible=bool(always)),
        )

    def set_chat_tools(
        self, conversation_id, tools: list[str], tool_choice: str, tool_rounds: float, always: list[str] | None = None
    ) -> None:
        """Keep the chat's tools with it: from its next reply on, the model is offered them. `always`: the tools
        still allowed without asking (an untick takes Always back); None leaves them as they are."""
        if conversation_id is None:
            if tools:
                raise user_error("Open or start a chat first, then pick its tools.")
            return
        conv = self.store.get(int(conversation_id))
        settings = ChatSettings.from_dict(conv.settings)
        settings = settings.replace(
            tools=tuple(tools or ()),
            tool_choice=tool_choice,
            tool_rounds=int(tool_rounds),
            tools_always=settings.tools_always
            if always is None
            else tuple(k for k in settings.tools_always if k in always),
        )
        self.store.update(conv.id, settings={**conv.settings, **settings.to_dict()})

    def _settings(self, conversation_id) -> ChatSettings:
        return ChatSettings.from_dict(self.store.get(int(conversation_id)).settings if conversation_id else None)

    # ---- a reply's rounds -----------------------------------------------------------------------------------

    def tool_rounds(self, conversation_id: int, system_prompt: str, settings: ChatSettings, backend):
        """The chat's tools for a reply: (the prompt of its first round, its ToolRounds), or None when the chat has
        none on. Raises gr.Error when its tools cannot be had (a server that does not start says why)."""
        if not settings.tools:
            return None
        if self.mcp is None:
            raise user_error(
                f"This chat has tools on, but no MCP servers are set up ({self.mcp_problem or 'no mcp.json'}): "
                "fix mcp.json and press Reload in the Tools panel, or turn the chat's tools off."
            )
        listed = []
        for server in dict.fromkeys(key.split("/", 1)[0] for key in settings.tools):
            try:
                listed += self.mcp.tools(server)
            except McpError as e:
                raise user_error(f"{e} Turn its tools off in the Tools panel to chat without them.") from None
        tools = chat_tools(listed, settings.tools)
        if not tools:
            raise user_error("None of the chat's tools is offered by its servers any more: pick others in Tools.")
        prompt = ToolPrompt(tuple(tools), "first" if settings.tool_choice == "first" else "auto")

        def always() -> set[str]:  # as the chat has them now: the Tools panel may take one back mid-reply
            return set(self._settings(conversation_id).tools_always)

        def remember_always(key: str) -> None:
            conv = self.store.get(conversation_id)
            now = ChatSettings.from_dict(conv.settings)
            self.store.update(conversation_id, settings={**conv.settings, "tools_always": [*now.tools_always, key]})

        rounds = ToolRounds(
            self.mcp,
            self.store,
            conversation_id,
            system_prompt,
            prompt,
            settings.tool_rounds,
            always,
            lambda messages, round_prompt: backend.submit(messages, settings, tools=round_prompt),
            remember_always,
        )
        return prompt, rounds

    def decide_call(self, conversation_id: int, token: str, decision: str) -> None:
        """A call's link clicked: Allow once, Always for this tool, or Deny (`token`: the call's, from its link)."""
        task = self.replies.get(conversation_id)
        rounds = task.rounds if task is not None and not task.done.is_set() else None
        if rounds is None or not rounds.decide(token, decision):
            raise user_error("That call is no longer waiting for an answer.")


def call_rows(message: Message, live: bool) -> list[dict]:
    """A reply's tool calls as the chatbot's rows: one waiting for the user shows its arguments and the three
    answers; the others fold into a block titled with the tool and how the call went, its result inside. What a
    tool returns is data: it shows in a code block, never as Markdown or links. `live`: the reply is still going
    (else a call left waiting or running ended with it: Pagoda stopped under it)."""
    rows = []
    for call in message.meta.get("tool_calls") or []:
        if not live and call.get("status") in ("asking", "allowed", "running"):
            call = {**call, "status": "ended"}
        plain_name = f"{call.get('server', '?')} › {call.get('tool', call.get('name', '?'))}"
        name = markdown_escaped(plain_name)  # a server names its tools: shown as text, not markup
        arguments = _pretty(call.get("arguments", ""))
        status = call.get("status", "asking")
        if status == "asking":
            link = f"#pagoda-{{}}-{call.get('token', '')}"
            answers = " · ".join(
                f"[{label}]({link.format(kind)})"
                for label, kind in (("Allow once", "allow"), ("Always for this tool", "always"), ("Deny", "deny"))
            )
            rows.append(
                {"role": "assistant", "content": f"🔧 **{name}** wants to run with\n\n{arguments}\n\n{answers}"}
            )
            continue
        took = f" in {call['seconds']:.1f} s" if call.get("seconds") and status in ("done", "error") else ""
        body = f"Arguments\n\n{arguments}"
        if call.get("result"):
            body += f"\n\n{'Error' if status == 'error' else 'Result'}\n\n{fenced(inert(call['result']))}"
        title = f"🔧 {inert(name)} · {CALL_STATES.get(status, status)}"
        metadata = {"title": title + took, "status": "pending" if status in ("running", "allowed") else "done"}
        rows.append({"role": "assistant", "content": body, "metadata": metadata})
    return rows


def _pretty(arguments: str) -> str:
    try:
        text = json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except ValueError:
        text = arguments
    return fenced(inert(text), "json")
