"""Reading a request body off the wire: bounded in size, validated strictly into protocol.py's models, and
described in /openapi.json (the routes read their bodies themselves, so FastAPI cannot)."""

from fastapi import Request
from pydantic import BaseModel, ValidationError

from entrypoints.openai.errors import APIError
from entrypoints.openai.limits import MAX_REQUEST_BYTES
from entrypoints.openai.protocol import RequestBody


def openapi_body(kind: type[BaseModel]) -> dict:
    """`openapi_extra` that documents a route's JSON body as `kind`: the routes read their bodies themselves
    (strictly, into OpenAI's error shape), so FastAPI would otherwise document none, and schema-driven clients
    and fuzzers would send only empty bodies. Nested models are written inline (no $defs in OpenAPI's place)."""
    schema = kind.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed `limit` bytes (never read whole)."""
    too_big = APIError(
        413,
        f"the request body is larger than this server's limit of {limit:,} bytes (--max-request-bytes); send less text",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, kind: type[RequestBody], limit: int = MAX_REQUEST_BYTES) -> RequestBody:
    """The body as `kind`, validated strictly as JSON: "2" is not a number nor "yes" a boolean, and invalid
    text (a lone surrogate), nesting beyond a limit or a 5,000-digit number are refused as invalid JSON."""
    raw = await read_body(request, limit)
    try:
        body = kind.model_validate_json(raw, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] == "json_invalid" and "recursion limit" in first["msg"]:
            raise APIError(400, "the request body nests too deeply (more than about 200 levels); flatten it") from None
        if first["type"] == "json_invalid":
            raise APIError(
                400, f"the request body is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})"
            ) from None
        if first["type"] == "model_type":
            raise APIError(400, "the request body must be a JSON object") from None
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None
    body.check_supported()
    return body


def body_from(kind: type[RequestBody], fields: dict) -> RequestBody:
    """Another API's request, translated into `fields`, as `kind`: validated and checked as a body sent here would
    be, a field that fails in a 400 that names it."""
    try:
        body = kind.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None
    body.check_supported()
    return body
