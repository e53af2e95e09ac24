"""Few-row matmul options per weight shape, timed the way a decode graph runs them.

    python -m bench.gemv_sweep     (CUDA only)

Each option is timed as `choose_gemv` times it (`cuda_timer`): back to back inside a CUDA graph,
cycling through weight copies that fill twice the L2 cache, as in a real step. Before 2026-11-30,
triton's do_bench timed one launch at a time, gaps included, and misled the choice. Options:
cuBLAS through F.linear, cuBLAS's GEMV through torch.mv, and the Triton kernel over tiles and
warp counts. Prints GB/s of weights read.
"""

import itertools

import torch
import torch.nn.functional as F
import triton

from engine.layers.gemv import _gemv_kernel, cold_copies, cuda_timer

SHAPES = [(1024, 2048), (1024, 3072), (4096, 1024), (6144, 1024), (151936, 1024)]  # (N, K): Qwen3-0.6B's


def main() -> None:
    torch.manual_seed(0)
    for n, k in SHAPES:
        nbytes = n * k * 2
        weights = cold_copies(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        turns = itertools.cycle(weights)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        us = {}
        us["F.linear"] = 1000 * cuda_timer(lambda: F.linear(x, next(turns)))
        us["torch.mv"] = 1000 * cuda_timer(lambda: torch.mv(next(turns), x[0]))
        for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
            if bn * bk > 8192 * 2 or bn * bk < 512 or bk > k:
                continue

            def run(bn=bn, bk=bk, warps=warps):
                w = next(turns)
                _gemv_kernel[(triton.cdiv(n, bn),)](
                    x,
                    w,
                    w,
                    out,
                    1,
                    n,
                    k,
                    x.stride(0),
                    k,
                    out.stride(0),
                    HAS_BIAS=False,
                    EVEN_K=k % bk == 0,
                    BLOCK_M=1,
                    BLOCK_N=bn,
                    BLOCK_K=bk,
                    num_warps=warps,
                )

            try:
                us[f"gemv {bn}x{bk} w{warps}"] = 1000 * cuda_timer(run)
            except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run
                print(f"  {n}x{k} gemv {bn}x{bk} w{warps}: {type(e).__name__}")
        best = sorted(us.items(), key=lambda kv: kv[1])
        line = ", ".join(f"{name} {t:.1f}us ({nbytes / t / 1e3:.0f} GB/s)" for name, t in best[:6])
        print(
            f"{n}x{k} ({nbytes / 2**20:.1f} MiB): F.linear {us['F.linear']:.1f}us, torch.mv {us['torch.mv']:.1f}us; "
            f"best: {line}",
            flush=True,
        )
        del weights


if __name__ == "__main__":
    main()
