"""The engine's `{token_id: logprob}` entries in OpenAI's two shapes.

Chat completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}, ...]}`. Completions (the legacy shape, which lm-evaluation-harness reads):
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}`, where an echoed
prompt's first token has no logprob (null). A token's text is what decoding it alone gives, as in
vLLM; its bytes are exact where the tokenizer is byte-level, so a character split across tokens can be
put back together.
"""

import re
from functools import lru_cache

# OpenAI's stand-in for a logprob too small to show (and JSON has no -Infinity).
MIN_LOGPROB = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """A token id's text and UTF-8 bytes, as logprobs entries report them (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_level and piece and all(c in _UNICODE_TO_BYTE for c in piece):
            return [_UNICODE_TO_BYTE[c] for c in piece]
        if piece and (match := _BYTE_FALLBACK.fullmatch(piece)):
            return [int(match.group(1), 16)]
        return list(self.text(token_id).encode("utf-8"))


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], top_logprobs: int, texts: TokenTexts
) -> list[dict]:
    """`choices[i].logprobs.content` for these tokens: each with its own logprob and the `top_logprobs`
    most likely tokens at its position, most likely first."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        top = sorted(entry.items(), key=lambda item: -item[1])[:top_logprobs]
        content.append(
            {
                "token": texts.text(token),
                "logprob": _clamp(entry[token]),
                "bytes": texts.bytes(token),
                "top_logprobs": [
                    {"token": texts.text(t), "logprob": _clamp(lp), "bytes": texts.bytes(t)} for t, lp in top
                ],
            }
        )
    return content


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, float] | None], texts: TokenTexts, text_offset: int = 0
) -> dict:
    """The legacy `choices[i].logprobs` for these tokens; `text_offset`: where the first one starts in the
    choice's text. An entry of None (an echoed prompt's first token) gives null logprobs."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries, strict=True):
        text = texts.text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else _clamp(entry[token]))
        # The chosen token and the top k, as OpenAI's "up to logprobs + 1" entries.
        out["top_logprobs"].append(None if entry is None else {texts.text(t): _clamp(lp) for t, lp in entry.items()})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out
