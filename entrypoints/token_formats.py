"""Reply formats read from the reply's tokens rather than its text, because they frame reasoning and tool calls in
special tokens the text leaves out: gpt-oss's harmony (entrypoints/harmony.py) and Gemma 4's channels
(entrypoints/gemma4_format.py). Which one a chat template speaks, and a parser for it."""

from entrypoints.gemma4_format import Gemma4Stream, template_speaks_gemma4
from entrypoints.harmony import HarmonyStream, template_speaks_harmony

# Both parse alike: feed(token_ids) and finish() give (reasoning, content, tool-call deltas)
TokenFormatStream = HarmonyStream | Gemma4Stream


def template_speaks_tokens(chat_template: str | None) -> bool:
    """Whether replies to this chat template are read from their tokens."""
    return template_speaks_harmony(chat_template) or template_speaks_gemma4(chat_template)


def token_format_stream(tokenizer) -> TokenFormatStream | None:
    """A parser for one reply, where the tokenizer's chat template speaks a token format; else None."""
    if template_speaks_harmony(tokenizer.chat_template):
        return HarmonyStream(tokenizer)
    if template_speaks_gemma4(tokenizer.chat_template):
        return Gemma4Stream(tokenizer)
    return None
