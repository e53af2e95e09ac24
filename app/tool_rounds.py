"""A reply that calls tools, round by round: the model's calls read out of its text, each shown to the user and run
only once they allow it (Allow once, Always for this tool, or Deny), its result stored with the call, and the model
asked again with the results, until it answers without calling or the chat's limit of rounds is reached.

The calls of a round are kept in their reply's meta ("tool_calls": one record per call, with its status, its
arguments and its result), so a chat's branches, exports and archives carry them as they carry any reply.

Only the page's own links (PagodaUI.message_action, a click) decide a call: nothing in the model's text or in a
tool's result can, however it is phrased. Stop ends a call that waits or runs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from app.backend import ReplyDelta, ReplyStream, chat_messages
from app.chat_tools import ToolPrompt, chat_turns
from app.mcp_servers import McpError
from entrypoints.openai.tool_calls import ToolCallStream, ToolPlan

if TYPE_CHECKING:
    from app.chat import ReplyTask
    from app.mcp_servers import McpHub

log = logging.getLogger("pagoda")
DECISIONS = ("allow", "always", "deny")
MAX_RESULT_CHARS = 20_000  # of a tool's result, kept and shown to the model: a larger one is cut, and says so


class CallParsingStream:
    """A reply's stream with its tool calls taken out of the text: the page shows the text, and `calls` (OpenAI's
    shape: id, and the function's name and arguments as JSON text) holds the calls once the reply has ended."""

    def __init__(self, stream: ReplyStream, prompt: ToolPrompt):
        self._stream = stream
        self.request_id = stream.request_id
        self._parser = ToolCallStream(ToolPlan([t.as_tool() for t in prompt.tools], "auto"))

    @property
    def calls(self) -> list[dict]:
        return self._parser.calls

    def __iter__(self) -> Iterator[ReplyDelta]:
        for delta in self._stream:
            text, _ = self._parser.feed(delta.text)
            if delta.finished:
                text += self._parser.finish()[0]
            yield dataclasses.replace(delta, text=text)

    def cancel(self) -> None:
        self._stream.cancel()

    def prefill_progress(self) -> tuple[int, int] | None:
        return self._stream.prefill_progress()


class ToolRounds:
    """The tool calls between one reply's rounds (ReplyTask calls next_round after each round that ended by
    itself). `submit(messages, prompt)` starts a round: (its stream, prompt tokens). `always()` is the chat's tools
    the user allowed for every call, as they are now (the Tools panel may take one back meanwhile), and
    `remember_always(key)` adds one.

    Each call waiting for the user has a token of its own, drawn at random and never shown to the model: only the
    page's link under the call carries it, so no text a model writes or a tool returns can name the call it would
    approve."""

    def __init__(
        self,
        hub: McpHub,
        store,
        conversation_id: int,
        system_prompt: str,
        prompt: ToolPrompt,
        max_rounds: int,
        always: Callable[[], set[str]],
        submit: Callable[[list[dict], ToolPrompt], tuple[ReplyStream, int]],
        remember_always: Callable[[str], None],
    ):
        self.hub, self.store, self.conversation_id, self.system_prompt = hub, store, conversation_id, system_prompt
        self.prompt, self.max_rounds = prompt, max_rounds
        self._always, self._submit, self._remember_always = always, submit, remember_always
        self.rounds = 1  # the round the reply is in (the first streams as it is made)
        self.cancelled = False
        self._lock = threading.Lock()
        self._asked: dict[str, threading.Event] = {}  # a waiting call's token -> set once decided
        self._decisions: dict[str, str] = {}
        self._keys: dict[str, str] = {}  # the tool each asked call is of
        self._running: concurrent.futures.Future | None = None

    def wrap(self, stream: ReplyStream, prompt: ToolPrompt | None = None) -> ReplyStream:
        """The stream with its calls read out of its text. A server's stream (app/remote.py) and a token format's
        (gpt-oss, Gemma 4) have them apart already."""
        return (
            stream if getattr(stream, "calls", None) is not None else CallParsingStream(stream, prompt or self.prompt)
        )

    # ---- from the page ----------------------------------------------------------------------------------------

    def decide(self, token: str, decision: str) -> bool:
        """The user's answer to the call whose link carries `token`: False when no call waits with it."""
        if decision not in DECISIONS:
            raise ValueError(f"A call is decided with one of {', '.join(DECISIONS)}, not {decision!r}.")
        with self._lock:
            event = self._asked.get(token)
            if event is None or event.is_set():
                return False
            if decision == "always":  # kept before the answer returns: the page shows it in Tools at once
                self._remember_always(self._keys[token])
            self._decisions[token] = decision
            event.set()
            return True

    def cancel(self) -> None:
        """Stop: a call waiting for the user ends as stopped, and one running is cancelled."""
        with self._lock:
            self.cancelled = True
            for event in self._asked.values():
                event.set()
            if self._running is not None:
                self._running.cancel()

    # ---- on the reply's thread --------------------------------------------------------------------------------

    def next_round(self, task: ReplyTask) -> bool:
        """Run the calls the round that just ended made (each once the user allows it) and start the next round in
        a new reply after it: False when the round made no calls, or Stop came."""
        calls = getattr(task.stream, "calls", None)
        if not calls or self.rounds > self.max_rounds:  # the answering round's calls are not run (a server's, say)
            return False
        message_id = task.message_id
        records = task.turn.tool_calls = [self._record(call) for call in calls]  # saved with the reply from now on
        with self._lock:  # before the page can show them: a click that came first found nothing to decide
            if self.cancelled:  # Stop came as the round ended: its events were set before these existed
                for record in records:
                    if record["status"] != "error":
                        record["status"] = "stopped"
            for record in records:
                if record["status"] == "asking":
                    self._asked[record["token"]] = threading.Event()
                    self._keys[record["token"]] = record["key"]
        task.calling = True
        try:
            self._run_calls(task, message_id, records)
            if self.cancelled:
                return False
            self._start_next_round(task, message_id)  # the page draws calls until its reply exists
            return True
        finally:
            task.calling = False

    def _run_calls(self, task: ReplyTask, message_id: int, records: list[dict]) -> None:
        """Each call in turn: asked, then run (or denied), its record saved with the reply at every change."""

        def save() -> None:
            self.store.update_message(message_id, task.turn.text, task.turn.meta())
            task.version += 1

        for index, record in enumerate(records):
            if record["status"] in ("error", "stopped"):
                continue
            if record["status"] == "asking" and record["key"] in self._always():  # Always, chosen meanwhile
                record["status"] = "allowed"
            if record["status"] == "asking":
                save()
                if self._ask(record["token"]) == "deny":
                    record["status"] = "denied"
                    continue
            if self.cancelled:  # Stop: this call and those after it do not run
                for rest in records[index:]:
                    if rest["status"] not in ("error", "denied"):
                        rest["status"] = "stopped"
                break
            record["status"] = "running"
            save()
            self._call(record)
        for record in records:
            record.pop("token", None)  # decided: the token is of no more use, and is not kept
        save()

    def _start_next_round(self, task: ReplyTask, message_id: int) -> None:
        self.rounds += 1
        # max_rounds rounds may call; the one after them must answer
        prompt = self.prompt if self.rounds <= self.max_rounds else dataclasses.replace(self.prompt, mode="answer")
        if prompt.mode == "first":  # a call before the answer: made; now the model may answer
            prompt = dataclasses.replace(prompt, mode="auto")
        reply = self.store.add_message(self.conversation_id, "assistant", "", after=message_id)
        task.begin_round(_NotYet(), reply.id, 0)  # a failure to submit is kept with the new reply
        task.calling = False
        history = chat_turns(self.store.path_to(self.conversation_id, message_id))
        stream, num_prompt_tokens = self._submit(chat_messages(self.system_prompt, history), prompt)
        # The last round may not call: what it writes is its answer, calls and all (a template whose calls are read
        # unconstrained could still write one)
        task.begin_round(stream if prompt.mode == "answer" else self.wrap(stream, prompt), reply.id, num_prompt_tokens)
        if self.cancelled:  # Stop came as the round started
            stream.cancel()

    def _record(self, call: dict) -> dict:
        function = call["function"]
        tool = self.prompt.named(function["name"])
        record = {"id": call["id"], "name": function["name"], "arguments": function["arguments"], "status": "asking"}
        if tool is None:  # a template whose calls are read unconstrained may name a tool it was not offered
            return {**record, "status": "error", "result": f"There is no tool named {function['name']!r}."}
        record.update(server=tool.server, tool=tool.tool, key=tool.key, token=secrets.token_hex(12))
        return record

    def _ask(self, token: str) -> str:
        """Wait for the user's decision on a call: "allow", "always", "deny", or "stop" (Stop came)."""
        self._asked[token].wait()
        with self._lock:
            return "stop" if self.cancelled else self._decisions[token]

    def _call(self, record: dict) -> None:
        try:
            arguments = json.loads(record["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            record.update(status="error", result="The call's arguments are not a JSON object.")
            return
        start = time.monotonic()
        try:
            with self._lock:
                if self.cancelled:
                    raise concurrent.futures.CancelledError
                self._running = self.hub.start_call(record["server"], record["tool"], arguments)
            # The server's own limit bounds the call; this one also bounds a restart that never answers
            result = self._running.result(self.hub.time_limit(record["server"]))
            text = result.text
            if len(text) > MAX_RESULT_CHARS:
                text = text[:MAX_RESULT_CHARS] + f"\n[cut: the result had {len(result.text):,} characters]"
            record.update(status="error" if result.is_error else "done", result=text)
        except concurrent.futures.CancelledError:
            record.update(status="stopped")
        except concurrent.futures.TimeoutError:
            self._running.cancel()
            record.update(status="error", result=f'MCP server "{record["server"]}" did not answer in time.')
        except McpError as e:
            record.update(status="error", result=str(e))
        finally:
            self._running = None
            record["seconds"] = round(time.monotonic() - start, 3)
        log.info("chat %d: tool %s: %s", self.conversation_id, record["key"], record["status"])


class _NotYet:
    """A round's stream before it is submitted: nothing to cancel yet."""

    request_id = ""

    def __iter__(self) -> Iterator[ReplyDelta]:
        return iter(())

    def cancel(self) -> None:
        pass

    def prefill_progress(self) -> None:
        return None
