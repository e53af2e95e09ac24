"""OpenAI's request bodies and response objects, as Pagoda takes and gives them (the error shape: errors.py).

The fields are OpenAI's, plus vLLM's `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` and
`priority`, and Ollama's names for some of them (ollama_fields.py). A field Pagoda cannot honour is refused with
a 400 that names it, never silently ignored.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from engine.front.sampling_params import MAX_LOGPROBS, MAX_PENALTY, SamplingParams, StructuredOutputsParams
from entrypoints.documents import DocumentError, file_part_block
from entrypoints.openai.errors import APIError
from entrypoints.openai.ollama_fields import OLLAMA_SAMPLER_FIELDS, adopt_ollama_fields

# Fields of OpenAI's (or vLLM's) that would change the reply and that Pagoda does not do: refused by name
# rather than ignored. Other unknown fields (`user`, `metadata`, `store`, ...) change nothing here.
REFUSED_FIELDS = {
    "functions": "functions is OpenAI's old form of tools: send `tools` instead",
    "function_call": "function_call is OpenAI's old form of tool_choice: send `tool_choice` instead",
    "audio": "audio output is not supported: Pagoda's models write text",
    "modalities": "modalities is not supported: Pagoda's models write text only; leave it out",
    "prediction": "prediction (predicted outputs) is not supported; leave it out",
    "web_search_options": "web search is not supported: Pagoda runs offline; leave it out",
    "best_of": "best_of is not supported: Pagoda returns one choice per request",
    "use_beam_search": "beam search is not supported; sample instead",
    **OLLAMA_SAMPLER_FIELDS,
    "prompt_logprobs": (
        "prompt_logprobs is not supported on this route; for a prompt's logprobs send it to /v1/completions with "
        "echo: true and logprobs"
    ),
}
# vLLM's older names for structured_outputs' fields
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be checked against REFUSED_FIELDS, then ignored

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch's generators take
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False  # vLLM's: the reply runs on past the model's end token, to max_tokens (benchmarks)
    stop_token_ids: list[int] | None = None  # vLLM's: more tokens that end the reply
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    # vLLM's: lower is more urgent. A request waits while a more urgent one runs (0 is the default).
    priority: int = 0
    # OpenAI's; for a model that thinks, "none" and "minimal" turn thinking off and the others leave it on
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict | None = None
    # vLLM's: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} | {"json_object": true}
    structured_outputs: dict | None = None
    # What the request set that does not apply here, each with why ("num_ctx: ..."): said in X-Pagoda-Ignored
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @property
    def ignored(self) -> list[str]:
        return self._ignored

    def check_supported(self) -> None:
        """Fields Pagoda would otherwise ignore: refuse them rather than answer something else."""
        for name in self.model_extra or {}:
            if name in REFUSED_FIELDS:
                raise APIError(400, REFUSED_FIELDS[name], param=name)
        adopt_ollama_fields(self)
        if self.n != 1:
            raise APIError(
                400, "n must be 1: Pagoda returns one choice per request; send several requests instead", param="n"
            )

    def constraint_fields(self) -> list[str]:
        """The fields that ask for a constraint on the reply (one, or the request is refused)."""
        guided = [
            name for name, value in (self.model_extra or {}).items() if name in GUIDED_FIELDS and value is not None
        ]
        return [
            name
            for name, value in (
                ("response_format", self.response_format is not None and self.response_format.get("type") != "text"),
                ("structured_outputs", self.structured_outputs),
            )
            if value
        ] + guided

    def constraint(self) -> StructuredOutputsParams | None:
        """What the reply must match: response_format, structured_outputs or vLLM's guided_* fields."""
        asked = self.constraint_fields()
        given = {name: self.model_extra[name] for name in asked if name in GUIDED_FIELDS}
        if len(asked) > 1:
            raise APIError(400, f"{' and '.join(asked)} both constrain the reply; send one of them", param=asked[1])
        try:
            if given:
                ((name, value),) = given.items()
                return StructuredOutputsParams(**{GUIDED_FIELDS[name]: value})
            if self.structured_outputs:
                return StructuredOutputsParams(**self.structured_outputs)
        except (TypeError, ValueError) as e:
            raise APIError(
                400, str(e).replace("StructuredOutputsParams", "structured_outputs"), param=asked[0]
            ) from None
        return response_format_constraint(self.response_format)

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams: the body's sampling fields as sent, with what the server decided (the
        reply's length, the logprobs the route asks for, the constraint on the reply)."""
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logit_bias=self.token_biases(),
                max_tokens=max_tokens,
                stop=self.stop,
                seed=self.seed,
                logprobs=logprobs,
                ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=constraint,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias with int token ids."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):
                raise APIError(400, f"logit_bias keys are token ids (digits), got {key!r}", param="logit_bias")
            biases[int(key)] = value
        return biases

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


def response_format_constraint(response_format: dict | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise APIError(
            400,
            f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
            param="response_format.type",
        )
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise APIError(
            400,
            "response_format.json_schema.schema must be a JSON schema (an object); send "
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            param="response_format.json_schema",
        )
    return StructuredOutputsParams(json=schema)


# Content-part types that carry an image (OpenAI's chat and Responses names)
IMAGE_PARTS = ("image_url", "input_image", "image")


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, as OpenAI returned them
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant's reasoning, as Pagoda returned it: not fed back, as the models' templates intend
    reasoning_content: str | None = None

    def for_template(self, index: int) -> dict:
        """The message as chat templates take it."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            if self.role != "assistant":
                raise APIError(
                    400,
                    f"messages.{index}: only assistant messages have tool_calls",
                    param=f"messages.{index}.tool_calls",
                )
            for j, call in enumerate(self.tool_calls):
                function = call.get("function")
                if not (
                    isinstance(function, dict)
                    and isinstance(function.get("name"), str)
                    and isinstance(function.get("arguments"), (str, dict))
                ):
                    raise APIError(
                        400,
                        f'messages.{index}.tool_calls.{j} must be {{"id": ..., "type": '
                        '"function", "function": {"name": ..., "arguments": ...}}',
                        param=f"messages.{index}.tool_calls",
                    )
            message["tool_calls"] = self.tool_calls
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") in IMAGE_PARTS:
                raise APIError(
                    400,
                    "images are not supported yet: Pagoda runs the language part of a model only (its vision part, "
                    "where the model has one, is not loaded); send the message as text",
                    param="messages",
                )
            if part.get("type") == "file":  # a document: its text, as a block where the part is
                file = part.get("file") if isinstance(part.get("file"), dict) else {}
                try:
                    parts.append(file_part_block(file.get("filename"), file.get("file_data"), file.get("file_id")))
                except DocumentError as e:
                    raise APIError(400, f"a file content part: {e}", param="messages") from None
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"only text and file content parts are supported, got type {part.get('type')!r}",
                    param="messages",
                )
            parts.append(part["text"])
        return "".join(parts)


# Arguments apply_chat_template takes itself: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "tokenize",
    "return_tensors",
    "return_dict",
    "continue_final_message",
    "chat_template",
    "tokenizer",
}


class ChatCompletionBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # "none" | "auto" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool = True
    # Extra variables for the chat template, as vLLM takes them: e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {', '.join(reserved)}: Pagoda sets those itself",
                param="chat_template_kwargs",
            )
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: set logprobs to true as well", param="top_logprobs")

    @property
    def looks_like_a_background_task(self) -> bool:
        """Open WebUI's title, tag, follow-up and query tasks: not streamed, and the last user message begins
        with its task templates' "### Task:" (its RAG template does too, but a chat with documents streams)."""
        users = [m for m in self.messages if m.role == "user"]
        return not self.stream and bool(users) and users[-1].text().lstrip().startswith("### Task:")

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None when not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    # 0 is allowed with echo: the prompt alone comes back, with its logprobs (how lm-evaluation-harness scores)
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.reasoning_effort is not None:
            raise APIError(
                400,
                "reasoning_effort is for chats with a model that thinks; a completion has no "
                "thinking switch: leave it out",
                param="reasoning_effort",
            )
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400,
                "max_tokens=0 returns nothing without echo: set echo to true (to score the prompt) "
                "or ask for at least one token",
                param="max_tokens",
            )

    @property
    def echo_only(self) -> bool:
        """Echo the prompt and generate nothing (max_tokens=0)."""
        return self.echo and self.max_tokens == 0


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # `user` and the like change nothing

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"

    def check_supported(self) -> None:
        """Nothing to refuse: every field Pagoda does not know leaves the vectors as they are."""

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string, or token ids."""
        given = self.input
        return [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)


# ---- responses ----------------------------------------------------------------------------------------------
class Response(BaseModel):
    """A response object. In its JSON, a field left at None is absent unless the server set it (to None too), as
    OpenAI's objects have it: a chunk's delta holds only what it brings, `logprobs` is null when not asked."""

    def model_post_init(self, context) -> None:
        self.model_fields_set.update(name for name in type(self).model_fields if getattr(self, name) is not None)

    def json_body(self) -> dict:
        return self.model_dump(exclude_unset=True)


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "pagoda"
    max_model_len: int | None  # None: not loaded, so not known yet
    status: Literal["loaded", "loading", "not-loaded"]  # LM Studio's word: models served by name load on first use


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(Response):
    cached_tokens: int


class CompletionTokensDetails(Response):
    reasoning_tokens: int


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None  # for models that think


class AssistantMessage(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChoice(Response):
    index: int = 0
    message: AssistantMessage
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id it ended on


class CompletionChoice(Response):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id it ended on


class Delta(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChunkChoice(Response):
    index: int = 0
    delta: Delta
    logprobs: dict | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id it ended on


class CompletionResponse(Response):
    """A whole reply or one streamed chunk, of either route: `object` says which."""

    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice] | list[ChatChunkChoice] | list[CompletionChoice]
    usage: Usage | None = None
