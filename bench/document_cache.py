"""A document attached to a chat is read once: time to first token for the first question about it, the second
question in the same chat, and a question in a second chat that attaches the same file.

    python -m bench.document_cache [--doc-tokens 3000] [--repeats 3] [--model PATH]

It drives the app's own path (PagodaUI: attach_files, respond; the reply's stored first-token time and prefix-cache
count) on the bundled SmolLM2-135M-Instruct GGUF, served as the app serves it (an EngineThread). Each repeat uses a
new document, so its first question starts cold. Medians over --repeats; replies are greedy and 8 tokens long.
"""

import argparse
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

from app.backend import LocalBackend
from app.model_host import ModelHost
from app.store import ConversationStore
from app.ui import PagodaUI
from engine import EngineThread
from entrypoints.cli import default_model

TEXT = Path("/usr/share/common-licenses/GPL-3")
GREEDY_8 = (0.0, 1.0, -1, 0.0, 1.0, 16)  # temperature, top_p, top_k, min_p, repetition penalty, max tokens (16 min)
SYSTEM = "Answer from the attached document."


def document(tokenizer, tokens: int, repeat: int) -> str:
    """About `tokens` tokens of prose, different for each repeat (so nothing of it is cached yet)."""
    words = (TEXT.read_text() if TEXT.exists() else "the quick brown fox jumps over the lazy dog " * 2000).split()
    text = f"Document {repeat}. "
    step = 200
    start = repeat * 97
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(words[start : start + step]) + " "
        start = (start + step) % max(1, len(words) - step)
    return text


def ask(ui: PagodaUI, chat: int, question: str, page) -> dict:
    for _ in ui.respond(chat, question, SYSTEM, *GREEDY_8, page):
        pass
    return ui.store.messages(chat)[-1].meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder or GGUF (default: the bundled SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, label = default_model(args.model)
    thread = EngineThread.load(model)
    host = ModelHost()
    host.backend = LocalBackend(thread, label)
    folder = Path(tempfile.mkdtemp(prefix="pagoda-doc-bench-"))
    ui = PagodaUI(ConversationStore(folder / "chats.db"), host)
    page = SimpleNamespace(session_hash="bench")
    first, same_chat, other_chat = [], [], []
    try:
        for r in range(args.repeats):
            path = folder / f"document-{r}.txt"
            path.write_text(document(thread.tokenizer, args.doc_tokens, r))
            a, b = ui.store.create(system_prompt=SYSTEM).id, ui.store.create(system_prompt=SYSTEM).id
            ui.attach_files(a, [str(path)], page)
            cold = ask(ui, a, "What is this document about?", page)
            if cold["cached_tokens"] > 64:  # the chat template's start may be cached; the document must not be
                raise SystemExit(f"the first question found {cold['cached_tokens']} cached tokens: the bench is broken")
            again = ask(ui, a, "Who wrote it?", page)
            ui.attach_files(b, [str(path)], page)
            elsewhere = ask(ui, b, "Summarise it in one line.", page)
            first.append(cold)
            same_chat.append(again)
            other_chat.append(elsewhere)
            print(
                f"repeat {r}: prompt {cold['prompt_tokens']:,} tokens; TTFT {cold['ttft_s'] * 1000:.0f} ms cold, "
                f"{again['ttft_s'] * 1000:.0f} ms same chat ({again['cached_tokens']:,} cached), "
                f"{elsewhere['ttft_s'] * 1000:.0f} ms second chat ({elsewhere['cached_tokens']:,} cached)"
            )
    finally:
        thread.shutdown()

    def median(runs: list[dict]) -> float:
        return statistics.median(m["ttft_s"] for m in runs)

    cold_s = median(first)
    print(f"TTFT, median of {args.repeats}: first question {cold_s * 1000:.0f} ms")
    print(f"  second question, same chat:   {median(same_chat) * 1000:6.0f} ms = {median(same_chat) / cold_s:.3f}x")
    print(f"  a second chat, same file:     {median(other_chat) * 1000:6.0f} ms = {median(other_chat) / cold_s:.3f}x")


if __name__ == "__main__":
    main()
