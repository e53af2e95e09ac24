"""A terminal chat with the engine, on the bundled model unless told otherwise.

python -m entrypoints.demo [model]
"""

import logging
import sys

from engine import LLM, SamplingParams
from entrypoints.cli import default_model


def main(model: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, name = default_model(model)
    llm = LLM(model)
    s = llm.stats()
    print(f"Loaded {name} on {s.device} ({s.dtype}), {s.num_blocks} KV blocks. Empty line or Ctrl-D quits.")
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, seed=0)
    interactive = sys.stdin.isatty()
    pending = None if interactive else ["What is a KV cache, in one sentence?"]
    while True:
        if pending is not None:
            if not pending:
                return 0
            user = pending.pop(0)
            print(f"> {user}")
        else:
            try:
                user = input("> ").strip()
            except EOFError:
                return 0
            if not user:
                return 0
        messages.append({"role": "user", "content": user})
        request_id = llm.add_request(llm.encode_chat(messages), params)
        text = ""
        while llm.has_unfinished_requests():
            for out in llm.step():
                if out.request_id == request_id:
                    print(out.new_text, end="", flush=True)
                    text += out.new_text
        print()
        messages.append({"role": "assistant", "content": text})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
