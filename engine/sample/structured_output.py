"""Constrained decoding: a reply held to a JSON schema, a regex, a choice or a grammar.

llguidance compiles each constraint to a matcher that, token by token, knows which tokens may come
next. Each step, the host fills one bitmask row per constrained request (while the device runs the
forward pass), the sampler sets the logits of the tokens a row forbids to -inf, and after sampling
each matcher takes its request's token. Free and constrained requests share the step; the prefix
cache is untouched, since only sampling changes.

llguidance rather than xgrammar, measured on the bundled SmolLM2's 49k-token vocabulary
(bench/RESULTS.md, "Structured output"): both compile a schema in a few ms and fill a mask in
microseconds (llguidance ~12 us, xgrammar ~5 us per row), but xgrammar needs triton and
apache-tvm-ffi on every install, and llguidance needs nothing.
"""

import json
import logging
import re
import threading
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from engine.front.sampling_params import StructuredOutputsParams

log = logging.getLogger("engine")

# JSON as json.dumps writes it: one space after ':' and ',' and no other whitespace. Free whitespace
# lets a small model write newlines until max_tokens instead of the next key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar."""
    import llguidance

    Matcher = llguidance.LLMatcher
    if params.json is not None:
        return Matcher.grammar_from_json_schema(json.dumps(params.json), defaults=JSON_OPTIONS)
    if params.json_object:
        return Matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if params.regex is not None:
        return Matcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return Matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to it


# llguidance's compiler recurses once per rule of a chain of rules (about 2.7 KB of stack a rule, measured): a
# grammar of 4,000 chained rules, 100 KB of text, overflowed the 8 MiB stack of a Linux thread and killed the
# server with a segfault (macOS gives a thread 512 KiB). So constraints compile on a stack of their own, and a
# grammar may have this many rules, which that stack holds with room to spare.
MAX_GRAMMAR_RULES = 10_000
_COMPILE_STACK_BYTES = 256 << 20  # address space reserved, not memory used
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w.]*\s*(?::|::=)", re.MULTILINE)  # a Lark or GBNF definition
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is one setting for the process


def _on_a_deep_stack(build: Callable[[], object]) -> object:
    """`build()`, run in a thread of its own with a stack of _COMPILE_STACK_BYTES; its error is raised here."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = build()
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(_COMPILE_STACK_BYTES)
        try:
            worker = threading.Thread(target=run, name="pagoda-grammar-compile")
            worker.start()
        finally:
            threading.stack_size(previous)
    worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


MAX_ERROR_CHARS = 1000


def compile_error_message(error: str) -> str:
    """llguidance's error as a client can act on it: without a Rust backtrace, bounded, and a panic of its compiler
    said plainly."""
    if "symbols.len() < u16::MAX" in error:
        return (
            "the constraint is too large: it compiles to more than 65,000 grammar symbols, llguidance's limit; "
            "give fewer choices, properties or rules"
        )
    text = bounded(error, one_line=False) or "unknown error"
    if text.startswith("panic:"):
        return f"the constraint could not be compiled (llguidance failed: {text.removeprefix('panic:').strip()})"
    return f"the constraint does not compile: {text}"


class StructuredOutputs:
    """One engine's constraint compiler: the model's vocabulary as llguidance sees it (built on first
    use, about 0.3 s) and a cache of compiled matchers.

    Compiling is slow for a large constraint (a 4,000-property schema: about 1 s), and thread-safe: EngineThread
    compiles in the caller's thread, outside its lock, so that the engine steps on meanwhile. Each request gets a
    copy of the compiled matcher (microseconds); a server's clients repeat a few schemas."""

    CACHED = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.hf_tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # guards the cache and the tokenizer's first build, never a compile
        self._compiled: dict[str, object] = {}  # StructuredOutputsParams.key() -> unused matcher, the newest last
        self.compiles = 0  # constraints compiled (not taken from the cache)

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build_tokenizer()
            return self._tokenizer

    def _build_tokenizer(self):
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        if not isinstance(self.hf_tokenizer, PreTrainedTokenizerFast):
            raise ValueError(
                "structured outputs need a fast (Rust) tokenizer, and this model's is "
                f"{type(self.hf_tokenizer).__name__}; load a model with a tokenizer.json"
            )
        # the model's end-of-reply ids that the tokenizer spells (a config may name others)
        eos = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)] or None
        return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)

    def grammar(self, params: StructuredOutputsParams) -> "Grammar":
        """A fresh matcher for one request; raises ValueError, naming the problem, for a constraint that
        does not compile (an invalid schema, regex or grammar) or is too large."""
        key = params.key()
        with self._lock:
            compiled = self._compiled.pop(key, None)
            if compiled is not None:
                self._compiled[key] = compiled  # now the newest
        if compiled is None:
            if params.grammar is not None and (rules := len(_RULE.findall(params.grammar))) > MAX_GRAMMAR_RULES:
                raise ValueError(
                    f"structured_outputs: the grammar has {rules:,} rules, more than the "
                    f"{MAX_GRAMMAR_RULES:,} Pagoda compiles; give a smaller grammar"
                )
            compiled = _on_a_deep_stack(lambda: self._compile(params))
            with self._lock:
                self.compiles += 1
                self._compiled[key] = compiled
                if len(self._compiled) > self.CACHED:
                    del self._compiled[next(iter(self._compiled))]
        return Grammar(compiled.deep_copy(), self.eos_token_ids)

    def _compile(self, params: StructuredOutputsParams):
        import llguidance

        try:
            text = grammar_text(params)
        except ValueError as e:
            raise ValueError(f"structured_outputs: {e}") from None
        # Validated first, as before the cache: the matcher is built only from a grammar llguidance accepts
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"structured_outputs: {compile_error_message(error)}")
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {compile_error_message(matcher.get_error())}")
        # The first token's mask, on a copy: a constraint that fails there (`{"$ref": "#"}` allows no reply at all;
        # 2,010 choices pass a limit of the parser) is refused now, before the request is queued, rather than at its
        # first step. Once per constraint: the compiled matcher is cached.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise ValueError(
                f"structured_outputs: no reply can follow this constraint from its first token "
                f"({bounded(probe.get_error())}); check that some value satisfies it, or make it simpler"
            )
        return matcher


class Grammar:
    """One request's constraint as its reply grows: the matcher has taken every output token the host has read."""

    def __init__(self, matcher, eos_token_ids: list[int]):
        self.matcher, self.eos_token_ids = matcher, eos_token_ids
        self.dead_end = False  # it allowed no token at all: the reply cannot be completed (fill_bitmask)

    @property
    def finished(self) -> bool:
        """The reply is complete: nothing may follow (it has taken the end of the reply, or failed)."""
        return self.dead_end or self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def failure(self) -> str | None:
        """Why the reply could not follow the constraint (None: it did, so far). Such a reply ended with "stop"
        and broke the constraint ("{", "choice"), and the client took it for a valid one."""
        if self.matcher.is_error():
            return "the reply could not follow its constraint: " + bounded(self.matcher.get_error())
        if self.dead_end:
            return "the constraint allows no way to go on from here (it cannot be completed); check that it can end"
        return None

    def consume(self, token: int, request_id: str) -> None:
        """Take the request's sampled token (which its mask allowed)."""
        if not self.matcher.consume_token(token) and self.matcher.is_error():
            log.warning(
                "request %s: the constraint refused token %d: %s", request_id, token, bounded(self.matcher.get_error())
            )


def bounded(error: str, one_line: bool = True) -> str:
    """llguidance's error in at most MAX_ERROR_CHARS (one error held a whole 1 MB grammar), without the parser's
    state and grammar, or a backtrace; `one_line`: its whitespace runs as single spaces (for the log)."""
    text = re.split("<backtrace>|<state>", error)[0].strip()
    text = " ".join(text.split()) if one_line else text
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


@lru_cache(maxsize=1)
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def fill_bitmask(grammars: list[Grammar], vocab_size: int, parallel: bool = False) -> np.ndarray:
    """One row per grammar of 32-bit words, bit t of the row set when token t may come next. A grammar
    that has finished allows only the end of the reply. `parallel`: on llguidance's thread pool, for a
    host that is otherwise waiting for its GPU. On a CPU the pool measured no better than this thread
    (2 cores, bench/structured_output.py), and its threads would compete with the forward pass's."""
    import llguidance.torch as lt
    import torch

    bitmask = torch.zeros(len(grammars), (vocab_size + 31) // 32, dtype=torch.int32)
    live = [(g.matcher, row) for row, g in enumerate(grammars) if not g.finished]
    if parallel and live:
        lt.fill_next_token_bitmask_par(_executor(), live, bitmask)
    else:
        for matcher, row in live:
            lt.fill_next_token_bitmask(matcher, bitmask, row)
    mask = bitmask.numpy()
    for row in np.flatnonzero(~mask.any(axis=1)):  # nothing allowed: end the reply rather than sample at random
        if not grammars[row].finished:  # and say why, unless it ended as it should
            grammars[row].dead_end = True
        for eos in grammars[row].eos_token_ids:
            mask[row, eos // 32] |= np.array(1 << (eos % 32), np.uint32).view(np.int32)
    return mask
