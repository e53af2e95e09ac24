"""Reasoning split from the answer: the `<think>...</think>` text of Qwen3 and the DeepSeek-R1 distills.

Qwen3 writes `<think>` itself (unless `enable_thinking=False` puts an empty block in the prompt); an R1
distill's template ends the prompt inside `<think>`, so its reply starts as reasoning. Either way the
reasoning ends at `</think>`, and the whitespace after it belongs to neither part. A reply that never
closes its reasoning (cut off by max_tokens) is all reasoning, as vLLM's R1 parser has it.
"""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template is a thinking model's (it writes or expects <think> blocks)."""
    return bool(chat_template) and THINK_OPEN in chat_template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the prompt ends inside a <think> block (R1 distills' templates end it so)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def partial_suffix(text: str, marker: str) -> int:
    """How many of `text`'s last characters could be the start of `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits a reply's text, increment by increment, into (reasoning, content). Text that may be the start
    of a tag is held back until the next increment shows what it is."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.buffer = ""
        self.after_open = False  # strip the newlines that follow <think>
        self.after_close = False  # strip the whitespace that follows </think>
        self.reasoning = self.content = ""  # everything split so far

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its reasoning now."""
        return self.state == "reasoning"

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.buffer, self.after_open = "reasoning", head[len(THINK_OPEN) :], True
            elif THINK_OPEN.startswith(head) and not final:
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.after_open:
                self.buffer = self.buffer.lstrip("\n")
                self.after_open = not self.buffer
            end = self.buffer.find(THINK_CLOSE)
            if end >= 0:
                reasoning = self.buffer[:end]
                self.state, self.buffer, self.after_close = "content", self.buffer[end + len(THINK_CLOSE) :], True
            else:
                keep = 0 if final else partial_suffix(self.buffer, THINK_CLOSE)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        if self.state == "content":
            if self.after_close:
                self.buffer = self.buffer.lstrip()
                self.after_close = not self.buffer and not final
            content, self.buffer = self.buffer, ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply is complete."""
        return self.feed("", final=True)
