"""What a call of the K-quant kernel costs inside a compiled decode graph, against an eager call (issue 38, item 2).

    python -m bench.custom_op_cost [--threads 2] [--calls 40] [--width 256]

A chain of --calls products by small random Q4_K weights (--width x --width, so that the call's fixed costs, not
its arithmetic, are what is timed), each added back into x, is run eagerly and as one graph compiled the way
engine/runner/compiled_decode.py compiles decode steps (inductor with its C++ wrapper). Prints microseconds per
call of each, and of one lone eager call.
"""

import argparse
import time

import torch
from torch._inductor.compile_fx import compile_fx

from engine.quantization import kquant


def random_q4_k(rows: int, cols: int) -> torch.Tensor:
    blocks = torch.randint(0, 256, (rows, cols // 256, 144), dtype=torch.uint8)
    blocks[:, :, 0:4] = torch.tensor([0x00, 0x20, 0x00, 0x20], dtype=torch.uint8)  # d, dmin: small fp16 values
    return blocks.reshape(rows, -1).contiguous()


def seconds_per_call(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--width", type=int, default=256, help="a multiple of 256")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    namespace = kquant.ops()
    if namespace is None:
        raise SystemExit("the K-quant kernel is not built here (see the log); nothing to measure")
    kind, act = kquant.KINDS["Q4_K"], kquant.ACTS["int8"]
    weights = [random_q4_k(args.width, args.width) for _ in range(args.calls)]

    def chain(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        for w in ws:
            x = x + namespace.kquant_mm(x, w, kind, act) * 1e-3
        return x

    x = torch.randn(1, args.width)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": True}))
        return graphs[-1]

    compiled = torch.compile(chain, backend=backend, fullgraph=True, dynamic=False)
    if not torch.allclose(compiled(x, *weights), chain(x, *weights), atol=1e-4):
        raise SystemExit("the compiled chain disagrees with the eager one")
    lone = seconds_per_call(lambda: namespace.kquant_mm(x, weights[0], kind, act), 2000)
    eager = seconds_per_call(lambda: chain(x, *weights), 200) / args.calls
    graph = seconds_per_call(lambda: compiled(x, *weights), 200) / args.calls
    print(
        f"threads {args.threads}, {args.width}x{args.width} Q4_K: one eager call {lone * 1e6:.1f} us; in a chain of "
        f"{args.calls} (each + an add): eager {eager * 1e6:.1f} us a call, compiled graph {graph * 1e6:.1f} us a call"
    )


if __name__ == "__main__":
    main()
