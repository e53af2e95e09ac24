"""Few-row matmul options per weight shape, timed the way a decode graph runs them.

    python -m bench.gemv_sweep     (CUDA only)

Each option runs 64 times back to back inside a CUDA graph, cycling through enough weight copies
(>= 256 MB) that the L2 cache holds none of them, as in a real step (`choose_gemv` times the same
way since 2026-11-30; before, triton's do_bench timed one launch at a time, gaps included). Options: cuBLAS through F.linear, cuBLAS's GEMV through torch.mv, and the Triton
kernel over tiles and warp counts. Prints GB/s of weights read.
"""
import itertools

import torch
import torch.nn.functional as F
import triton

from engine.layers.gemv import _gemv_kernel

SHAPES = [(1024, 2048), (1024, 3072), (4096, 1024), (6144, 1024), (151936, 1024)]  # (N, K): Qwen3-0.6B's


def graph_time_us(fn, copies: int) -> float:
    """Microseconds per call of fn(i) for i cycling over the copies, inside one CUDA graph."""
    calls = 64
    for i in range(3):
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * calls)


def main() -> None:
    torch.manual_seed(0)
    for n, k in SHAPES:
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        results = {}
        results["F.linear"] = graph_time_us(lambda i: F.linear(x, weights[i]), copies)
        results["torch.mv"] = graph_time_us(lambda i: torch.mv(weights[i], x[0]), copies)
        for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8)):
            if bn * bk > 8192 * 2 or bn * bk < 512 or k % bk and bk > k:
                continue

            def run(i, bn=bn, bk=bk, warps=warps):
                _gemv_kernel[(triton.cdiv(n, bn),)](x, weights[i], weights[i], out, 1, n, k, x.stride(0), k, out.stride(0),
                                                    HAS_BIAS=False, EVEN_K=k % bk == 0, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk,
                                                    num_warps=warps)
            try:
                results[f"gemv {bn}x{bk} w{warps}"] = graph_time_us(run, copies)
            except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run
                print(f"  {n}x{k} gemv {bn}x{bk} w{warps}: {type(e).__name__}")
        best = sorted(results.items(), key=lambda kv: kv[1])
        line = ", ".join(f"{name} {us:.1f}us ({nbytes / us / 1e3:.0f} GB/s)" for name, us in best[:6])
        print(f"{n}x{k} ({nbytes / 2**20:.1f} MiB): F.linear {results['F.linear']:.1f}us, torch.mv {results['torch.mv']:.1f}us; best: {line}", flush=True)
        del weights


if __name__ == "__main__":
    main()
