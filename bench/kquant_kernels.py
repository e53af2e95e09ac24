"""The K-quant kernel (engine/quantization/kquant.py) alone against the kernels PyTorch's path holds K-quants in,
per weight shape and rows of x, in alternating rounds (issue 38).

    python -m bench.kquant_kernels [--threads 2] [--rounds 3]

"old" is HalvesSplitInt4Matmul for Q6_K, Int4PackMatmul for Q4_K, SplitInt4Matmul for Q5_K; then the native build
with int8 and float32 activations and the AVX2-only build. Random blocks; one weight at a time, so these are
cache speeds where it fits the L3. GB/s counts the file's bytes of the weight.
"""

import argparse
import time

import numpy as np
import torch

from engine.loader.gguf_blocks import decode_stored
from engine.quantization import kquant
from engine.quantization.blocks import BlockWeight
from engine.quantization.kernels import HalvesSplitInt4Matmul, Int4PackMatmul, SplitInt4Matmul

OLD = {"Q6_K": HalvesSplitInt4Matmul, "Q4_K": Int4PackMatmul, "Q5_K": SplitInt4Matmul}
SHAPES = [("Q6_K", 2560, 9728), ("Q6_K", 4096, 4096), ("Q4_K", 9728, 2560), ("Q5_K", 4096, 4096)]


def random_weight(type_name: str, n: int, k: int, rng: np.random.Generator) -> BlockWeight:
    count = n * k // 256
    blocks = rng.integers(0, 256, size=(count, kquant.BLOCK_BYTES[type_name]), dtype=np.uint8)
    for at in (208,) if type_name == "Q6_K" else (0, 2):
        halves = (rng.uniform(1e-3, 1e-2, count) * rng.choice([-1, 1], count)).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(count, 2)
    bits, group = (8, 16) if type_name == "Q6_K" else ((4, 32) if type_name == "Q4_K" else (8, 32))
    return BlockWeight(
        torch.from_numpy(blocks.reshape(n, -1)),
        type_name,
        (n, k),
        bits,
        group,
        lambda b, cols: decode_stored(type_name, b, cols),
    )


def best_us(kernel, x: torch.Tensor, calls: int = 10) -> float:
    kernel(x)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        kernel(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    for type_name, n, k in SHAPES:
        qw = random_weight(type_name, n, k, rng)
        kernels = {
            "old": OLD[type_name](qw, torch.float32),
            "native/int8": kquant.KQuantMatmul(qw, torch.float32, isa="native", act="int8"),
            "native/f32": kquant.KQuantMatmul(qw, torch.float32, isa="native", act="f32"),
            "avx2/int8": kquant.KQuantMatmul(qw, torch.float32, isa="avx2", act="int8"),
        }
        for m in (1, 4, 16):
            x = torch.randn(m, k)
            best: dict[str, float] = {}
            for _ in range(args.rounds):
                for name, kernel in kernels.items():
                    best[name] = min(best.get(name, float("inf")), best_us(kernel, x))
            file_bytes = n * k // 256 * kquant.BLOCK_BYTES[type_name]
            print(
                f"{type_name} {n}x{k} rows {m}: "
                + ", ".join(f"{name} {us:.0f} us ({file_bytes / us / 1e3:.1f} GB/s)" for name, us in best.items()),
                flush=True,
            )


if __name__ == "__main__":
    main()
