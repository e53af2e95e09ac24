"""What the chat view and the Markdown export need to know about a reply's Markdown: where its code blocks are
(a reply cut mid-code leaves one open) and which `$…$` are inline math.

Gradio's chatbot renders LaTeX only between the delimiters it is given (ui.py's MATH_DELIMITERS). `$` is not
one of them: the browser's KaTeX would take "$5 and $10" for math. Here `$…$` becomes `\\(…\\)` only where
Pandoc's rule reads it as math: the opening `$` has a non-space on its right, the closing one a non-space on its
left and no digit after it. So "$5 and $10" stays prose, "$x^2$" is math. Code is left as it is."""

import re

__all__ = ["FENCE", "open_fence", "close_open_fence", "dollar_math"]

# A Markdown code fence: three or more backticks or tildes at the start of a line (list items indent theirs)
FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})(.*)$")
# An inline code span: a run of backticks, then text, then a run of the same length
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).*?(?<!`)\1(?!`)")
# Inline math by Pandoc's rule; not `$$` (display math, which the chatbot renders itself) nor an escaped `\$`
DOLLAR_MATH = re.compile(r"(?<![\\$])\$(?![\s$])([^$\n]*?[^\s\\$])\$(?![\d$])")


def _lines_in_code(text: str):
    """(line, whether it is inside or delimits a fenced code block) for each line; then the fence left open
    at the end (or None)."""
    opened = None  # (indent, fence) of the block open at this line
    for line in text.split("\n"):
        found = FENCE.match(line)
        if found is not None:
            indent, fence, rest = found.groups()
            if opened is None and not (fence[0] == "`" and "`" in rest):  # a backtick fence's info has no backticks
                opened = (indent, fence)
                yield line, True
                continue
            if opened is not None and fence[0] == opened[1][0] and len(fence) >= len(opened[1]) and not rest.strip():
                opened = None
                yield line, True
                continue
        yield line, opened is not None
    yield None, (None if opened is None else opened[0] + opened[1])


def open_fence(text: str) -> str | None:
    """The fence line that would close the code block `text` leaves open (a reply cut mid-code), or None."""
    *_, (_, left_open) = _lines_in_code(text)
    return left_open


def close_open_fence(text: str) -> str:
    """`text` with the code block it leaves open closed, so that what follows it is not read as code."""
    fence = open_fence(text)
    if fence is None:
        return text
    return text + ("" if text.endswith("\n") else "\n") + fence


def dollar_math(text: str) -> str:
    """`text` with its inline `$…$` math (see the module's note) written `\\(…\\)`, outside code."""
    if "$" not in text:
        return text
    lines = []
    for line, in_code in _lines_in_code(text):
        if line is None:
            break
        lines.append(line if in_code else _math_outside_code_spans(line))
    return "\n".join(lines)


def _math_outside_code_spans(line: str) -> str:
    parts, start = [], 0
    for span in CODE_SPAN.finditer(line):
        parts += [DOLLAR_MATH.sub(r"\\(\1\\)", line[start : span.start()]), span.group(0)]
        start = span.end()
    parts.append(DOLLAR_MATH.sub(r"\\(\1\\)", line[start:]))
    return "".join(parts)


def markdown_escaped(text: str) -> str:
    """A name (a file's, a tool's) as Markdown shows it literally: a name is not markup (nor a link)."""
    return "".join("\\" + ch if ch in "\\`*_[]()<>|~!#" else ch for ch in text)


def fenced(text: str, language: str = "") -> str:
    """`text` as a code block, shown as it is: its fence is longer than any run of backticks inside it, so the text
    cannot close the block and be read as Markdown (or links) after it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text}\n{fence}"


# The page acts on links to "#pagoda-<action>" (app/page/chat_tab.py's script). Markdown and HTML can spell the "#"
# other ways, which the browser reads as "#" all the same.
_ACTION_LINK = re.compile(r"(#|&#0*35;|&#x0*23;|&num;|%23)(pagoda)-", re.IGNORECASE)


def inert(text: str) -> str:
    """Text from a model, a tool or an import with any link to the page's own actions broken (a zero-width space
    after "pagoda"): only the links Pagoda itself draws act."""
    return _ACTION_LINK.sub(lambda m: f"{m.group(1)}{m.group(2)}\u200b-", text)
