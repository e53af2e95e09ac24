"""A remote backend: an OpenAI-compatible server (vLLM, SGLang, llama.cpp server, Ollama, another Pagoda).

The app keeps its conversations and its page; only the replies come from the server. This is a
small client on httpx (which Gradio already brings), not the `openai` package:

  GET  {base}/v1/models              the served models (vLLM also says each one's max_model_len)
  POST {base}/v1/chat/completions    stream: true, stream_options.include_usage: the reply as SSE
  GET  {base}/metrics                Prometheus text, when the server has it (the KV cache tab;
                                     app/remote_metrics.py reads it)

The server applies its own chat template, so a request carries messages, not token ids. Only
standard OpenAI sampling fields are sent (temperature, top_p, max_tokens, seed). top_k, min_p and
repetition_penalty are not OpenAI fields: they are sent only when moved off their "off" values
(-1, 0, 1), where vLLM, SGLang and llama.cpp's server honour them and a strict server may refuse
them with an error the user sees. Stop closes the HTTP connection; OpenAI-compatible servers abort
a request whose client went away.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

import httpx

from app.backend import BadSettings, ReplyDelta, json_constraint
from app.chat_settings import ChatSettings, as_chat_settings
from app.remote_metrics import parse_prometheus, summarize_metrics
from app.visualizer import render_remote_notice

if TYPE_CHECKING:
    from app.store_records import Message

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 300.0  # between two streamed chunks: a busy server may queue a request for a while
METRICS_TIMEOUT_S = 3.0
METRICS_TTL_S = 1.0  # the KV tab polls twice a second per page; the server is asked at most once a second
NO_METRICS_TTL_S = 30.0  # a server without /metrics is asked again only after this long
_OVERFLOW = re.compile(r"context|too long|max_model_len|maximum .*length|exceed", re.I)
_ids = count()


class RemoteError(Exception):
    """A failure talking to the server, worded for the user. `context_overflow`: the chat is too long for it."""

    def __init__(self, message: str, status: int | None = None, context_overflow: bool = False):
        super().__init__(message)
        self.status, self.context_overflow = status, context_overflow


def split_base_url(url: str) -> tuple[str, str]:
    """(root, api) for a server URL given with or without `/v1`: metrics live under the root, the API under api."""
    url = (url or "").strip()
    if not url:
        raise RemoteError("Give the server's URL, for example http://localhost:8000/v1.")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise RemoteError(f"{url} is not an http:// or https:// URL.")
    url = url.rstrip("/")
    root = url.removesuffix("/v1")
    return root, root + "/v1"


@dataclass
class RemoteModel:
    id: str
    max_model_len: int | None = None  # vLLM and Pagoda say it; others leave it unknown


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), or of the common variants."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return text[:300] if text and not text.lstrip().startswith("<") else response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, str):
            return err
        if isinstance(err, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(err.get(key), str):
                    return err[key]
            if isinstance(err.get("detail"), list):  # FastAPI validation errors
                return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in err["detail"])
    return json.dumps(body)[:300]


class RemoteClient:
    """Talks to one server. Thread-safe: every chat's reply streams over its own connection."""

    def __init__(self, base_url: str, api_key: str | None = None, transport: httpx.BaseTransport | None = None):
        self.root, self.api = split_base_url(base_url)
        self.api_key = (api_key or "").strip() or None
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.Client(
            headers=headers,
            transport=transport,
            follow_redirects=True,
            trust_env=False,
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        )
        self._streams: weakref.WeakSet[ChatStream] = weakref.WeakSet()

    @property
    def url(self) -> str:
        """The address to show: the API URL, never the key."""
        return self.api

    # ---- errors -----------------------------------------------------------------------------------
    def _transport_error(self, e: httpx.HTTPError) -> RemoteError:
        if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
            return RemoteError(f"Could not reach {self.api}: is the server running? ({e or type(e).__name__})")
        if isinstance(e, httpx.TimeoutException):
            return RemoteError(f"{self.api} did not answer in time ({type(e).__name__}).")
        return RemoteError(f"The connection to {self.api} failed: {e or type(e).__name__}.")

    def _status_error(self, response: httpx.Response) -> RemoteError:
        status = response.status_code
        if status == 401:
            if self.api_key:
                return RemoteError(f"{self.api} refused the API key (401): check it.", status)
            return RemoteError(f"{self.api} wants an API key (401): give one.", status)
        if status == 403:
            return RemoteError(f"{self.api} refused the request (403, forbidden): {_error_message(response)}", status)
        if status == 404 and response.request.url.path.endswith("/models"):
            return RemoteError(
                f"{self.api} has no /models: is it an OpenAI-compatible server, and is the URL its "
                "API root (often ending in /v1)?",
                status,
            )
        message = _error_message(response)
        return RemoteError(
            f"The server answered {status}: {message}",
            status,
            context_overflow=status in (400, 413, 422) and bool(_OVERFLOW.search(message)),
        )

    def _get(self, url: str, timeout: float) -> httpx.Response:
        try:
            response = self._http.get(url, timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)))
        except httpx.HTTPError as e:
            raise self._transport_error(e) from None
        return response

    # ---- the API ------------------------------------------------------------------------------------
    def models(self) -> list[RemoteModel]:
        """The served models, in the server's order."""
        response = self._get(self.api + "/models", 10.0)
        if response.status_code >= 400:
            raise self._status_error(response)
        try:
            data = response.json()["data"]
            return [
                RemoteModel(str(m["id"]), m["max_model_len"] if isinstance(m.get("max_model_len"), int) else None)
                for m in data
            ]
        except (ValueError, KeyError, TypeError):
            raise RemoteError(
                f"{self.api}/models did not answer with an OpenAI model list: is the URL right?"
            ) from None

    def chat(
        self,
        model: str,
        messages: list[dict],
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_tokens: int | None = None,
        seed: int | None = None,
        **extra,
    ) -> ChatStream:
        """Start a streamed chat completion. Refusals (bad key, too long a chat) raise RemoteError here,
        in the caller's thread; the reply then streams from the returned ChatStream."""
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": temperature,
            "top_p": top_p,
        }
        if max_tokens is not None:
            body["max_tokens"] = int(max_tokens)
        if seed is not None:
            body["seed"] = int(seed)
        body.update({k: v for k, v in extra.items() if v is not None})
        request = self._http.build_request(
            "POST", self.api + "/chat/completions", json=body, headers={"Accept": "text/event-stream"}
        )
        try:
            response = self._http.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self._transport_error(e) from None
        if response.status_code >= 400:
            try:
                response.read()
            except httpx.HTTPError:
                pass
            response.close()
            raise self._status_error(response)
        stream = ChatStream(self, response, f"remote-{next(_ids)}")
        self._streams.add(stream)
        return stream

    def metrics(self) -> dict | None:
        """What /metrics says of the cache and the queue (see `summarize_metrics`); None when there is no such page."""
        try:
            response = self._get(self.root + "/metrics", METRICS_TIMEOUT_S)
        except RemoteError:
            return None
        if response.status_code != 200 or "html" in response.headers.get("content-type", ""):
            return None
        samples = parse_prometheus(response.text)
        return summarize_metrics(samples) if samples else None

    def close(self) -> None:
        """Abort the replies still streaming from this server, and close the connections."""
        for stream in list(self._streams):
            stream.cancel()
        self._http.close()


class ChatStream:
    """The increments of one streamed reply. Iterate it; stop early or call cancel() to abort it.

    cancel() may come from another thread while this one waits for the next chunk: it shuts the
    socket down, which wakes the read at once, and the server sees the client go away."""

    def __init__(self, client: RemoteClient, response: httpx.Response, request_id: str):
        self.client, self.response, self.request_id = client, response, request_id
        self.finished = False
        self._calls: dict[int, dict] = {}  # the reply's tool calls by index, as their deltas build them
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        if self.finished or self._cancelled.is_set():
            return
        self._cancelled.set()
        network = self.response.extensions.get("network_stream")
        sock = network.get_extra_info("socket") if network is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def prefill_progress(self) -> None:
        return None  # a server streams nothing until its first token

    @property
    def calls(self) -> list[dict]:
        """The tool calls the reply made (OpenAI's shape: id, and the function's name and arguments as JSON text)."""
        return [self._calls[i] for i in sorted(self._calls)]

    def _take_calls(self, deltas: list) -> None:
        for delta in deltas:  # OpenAI streams a call's id and name first, then its arguments in pieces
            if not isinstance(delta, dict):
                continue
            call = self._calls.setdefault(
                delta.get("index", len(self._calls)),
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            call["id"] = delta.get("id") or call["id"]
            function = delta.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""

    def __iter__(self) -> Iterator[ReplyDelta]:
        reason, usage, done = None, None, False
        try:
            for line in self.response.iter_lines():
                if self._cancelled.is_set():
                    break
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = _json(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    raise RemoteError(
                        f"The server stopped the reply: {message}", context_overflow=bool(_OVERFLOW.search(message))
                    )
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    reasoning = reasoning_text(delta)
                    reason = choice.get("finish_reason") or reason
                    self._take_calls(delta.get("tool_calls") or [])
                    if text or reasoning:  # about one token a chunk; `usage` brings the exact count at the end
                        yield ReplyDelta(text, 1, reasoning=reasoning)
        except RemoteError:
            raise
        except Exception as e:  # the socket shut by cancel(), or the server gone
            if not self._cancelled.is_set():
                raise (
                    self.client._transport_error(e)
                    if isinstance(e, httpx.HTTPError)
                    else RemoteError(f"The connection to {self.client.api} broke: {e}")
                ) from None
        finally:
            self.response.close()  # also when the consumer stops early: the server sees the hang-up and aborts
        if self._cancelled.is_set() and not done:
            self.finished = True
            yield ReplyDelta("", 0, True, "abort")
            return
        if not done and reason is None:
            raise RemoteError(f"{self.client.api} closed the stream before the reply was finished.")
        self.finished = True
        counts = parse_usage(usage)
        yield ReplyDelta(
            "",
            0,
            True,
            "stop" if reason in (None, "tool_calls") else reason,  # a reply that called tools ended by itself
            counts.get("cached_tokens"),
            counts.get("prompt_tokens"),
            counts.get("completion_tokens"),
        )


def reasoning_text(delta: dict) -> str:
    """A streamed delta's reasoning: vLLM's and SGLang's `reasoning_content` (vLLM's newer `reasoning`), or
    Ollama's `thinking`."""
    for key in ("reasoning_content", "reasoning", "thinking"):
        value = delta.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def _json(data: str) -> dict:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RemoteError(f"The server sent a stream line that is not JSON: {data[:120]!r}") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"The server sent an unexpected stream line: {data[:120]!r}")
    return chunk


def parse_usage(usage: dict | None) -> dict:
    """prompt_tokens, completion_tokens and cached_tokens (prompt_tokens_details.cached_tokens) that are present."""
    if not isinstance(usage, dict):
        return {}
    out = {k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens") if isinstance(usage.get(k), (int, float))}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), (int, float)):
        out["cached_tokens"] = int(details["cached_tokens"])
    return out


# ---- the backend the app holds ---------------------------------------------------------------------
@dataclass
class RemoteBackend:
    """A connected server and the model chosen on it: app.backend's Backend, over HTTP."""

    client: RemoteClient
    model: str
    max_model_len: int | None = None
    models: list[str] = field(default_factory=list)
    _metrics: tuple[float, dict | None] = (0.0, None)
    kind = "remote"
    quantization = ""  # the server does not say
    thinks = True  # the server's template decides; a model that does not think ignores the switch

    @property
    def label(self) -> str:
        return f"Remote: {self.model} at {self.client.url}"

    @property
    def url(self) -> str:
        return self.client.url

    def submit(self, messages: list[dict], settings: ChatSettings | dict, tools=None) -> tuple[ChatStream, int]:
        settings = as_chat_settings(settings)  # a script's dict too
        top_k, min_p, penalty = settings.top_k, settings.min_p, settings.repetition_penalty
        extra = {
            "top_k": top_k if top_k > 0 else None,
            "min_p": min_p if min_p > 0 else None,
            "repetition_penalty": penalty if penalty != 1.0 else None,
        }
        if not settings.think:  # vLLM's and SGLang's switch for Qwen3-style templates
            extra["chat_template_kwargs"] = {"enable_thinking": False}
        if tools is not None:  # the server's own tool calling: it writes the calls, the chat runs them (tool_rounds)
            if settings.json_output:
                raise BadSettings("A chat cannot hold replies to JSON and call tools at once: turn JSON output off.")
            extra["tools"] = tools.specs()
            extra["tool_choice"] = {"first": "required", "answer": "none"}.get(tools.mode, "auto")
        constraint = json_constraint(settings)
        if constraint is not None:
            extra["response_format"] = (
                {"type": "json_object"}
                if constraint.json_object
                else {"type": "json_schema", "json_schema": {"name": "reply", "schema": constraint.json}}
            )
        stream = self.client.chat(
            self.model,
            messages,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=settings.max_tokens,
            seed=settings.seed,
            **extra,
        )
        return stream, 0  # the server counts the prompt with its own template; its usage says how many

    def prompt_tokens(self, messages: list[dict], settings: ChatSettings | dict) -> None:
        return None  # the server applies its own template: only it knows

    def context_meter(self, system_prompt: str, stored: list[Message]) -> str:
        """A server tokenizes with its own template: only its count at the last reply is known."""
        last = next((m for m in reversed(stored) if m.role == "assistant" and m.meta.get("prompt_tokens")), None)
        of = f" / {self.max_model_len:,}" if self.max_model_len else ""
        if last is None:
            return f"Context: unknown{of} tokens (the remote server counts them; its count shows after a reply)"
        used = last.meta["prompt_tokens"] + last.meta.get("output_tokens", 0)
        more = " plus what came after" if last.id != stored[-1].id else ""
        return f"Context: {used:,}{of} tokens at the last reply{more} (the server's count)"

    def kv_panel(self, owners: dict[str, str]) -> str:
        return render_remote_notice(self.metrics(), source=f"{self.model} at {self.client.url}")

    def device_label(self) -> str:
        return ""  # the label names the server

    def metrics(self) -> dict | None:
        """The server's metrics, asked at most once a second (a server without them: once in 30 s)."""
        at, value = self._metrics
        if time.monotonic() - at < (METRICS_TTL_S if value is not None else NO_METRICS_TTL_S) and at:
            return value
        value = self.client.metrics()
        self._metrics = (time.monotonic(), value)
        return value

    def close(self) -> None:
        self.client.close()


def connect(
    base_url: str, api_key: str | None = None, model: str | None = None, transport: httpx.BaseTransport | None = None
) -> RemoteBackend:
    """Reach the server, list its models and pick `model` (default: the first). Raises RemoteError."""
    client = RemoteClient(base_url, api_key, transport=transport)
    try:
        served = client.models()
        if not served:
            raise RemoteError(f"{client.url} serves no models.")
        model = (model or "").strip() or served[0].id
        chosen = next((m for m in served if m.id == model), None)
        if chosen is None:
            raise RemoteError(f"{client.url} does not serve {model!r}; it serves {', '.join(m.id for m in served)}.")
    except Exception:
        client.close()
        raise
    return RemoteBackend(client, chosen.id, chosen.max_model_len, [m.id for m in served])
