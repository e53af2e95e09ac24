"""GPU benchmarks of issue 4, each against transformers on the same GPU in the same run.

    python -m bench.gpu_bench [--quick] [--json out.json]

Uses a random-weight model with Qwen3-0.6B's exact config in bf16 (no download). Prints one
table last. `--smoke` runs every code path on CPU with a 2-layer model, for checking the script.
"""

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.common import qwen3_06b_config, save_random_model
from engine import LLM, SamplingParams

ROWS: list[tuple[str, str, str]] = []
VOCAB = [100000]
FAILURES: list[str] = []


def rand_token() -> int:
    return random.randrange(100, VOCAB[0])


def row(name: str, value: str, note: str = "") -> None:
    ROWS.append((name, value, note))
    print(f"{name:<44} {value:>16}  {note}", flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_breakdown(llm, prompt_len: int, out_dir: Path | None) -> None:
    """Where a batch-1 decode step's time goes: graph replay on the GPU vs the whole step."""
    rid = llm.add_request(
        [rand_token() for _ in range(prompt_len)], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    )
    for _ in range(10):
        llm.step()
    sync(llm.device.type)
    steps = 50
    t = time.perf_counter()
    for _ in range(steps):
        llm.step()
    step_ms = (time.perf_counter() - t) / steps * 1000
    graphs = llm.model_runner.graphs
    note = ""
    if graphs is not None and llm.device.type == "cuda":
        replay = graphs.graphs[1]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            replay.replay()
        end.record()
        torch.cuda.synchronize()
        note = f"graph replay alone {start.elapsed_time(end) / 100:.3f} ms on the GPU"
    row("batch-1 decode step, whole", f"{step_ms:.3f} ms", note)
    if out_dir is not None:
        text = write_profile(llm, lambda: [llm.step() for _ in range(20)], out_dir / "profile.txt")
        print("\n".join(text.splitlines()[:22]))
    llm.abort_request(rid)


def write_profile(llm, run, path: Path, rows: int = 25) -> str:
    """Profile `run()` (and the device work it queued): the busiest host ops, then on a GPU the
    kernels, as tables written to `path`. Returns the text."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        sync(llm.device.type)
    averages = prof.key_averages()
    text = averages.table(sort_by="self_cpu_time_total", row_limit=rows)
    if llm.device.type == "cuda":
        text += "\n" + averages.table(sort_by="self_cuda_time_total", row_limit=rows)
    path.write_text(text)
    return text


def profile_prefill(llm, prompt: list[int], path: Path) -> None:
    """Profile one cold prefill: where an eager forward's host time and kernel time go."""
    write_profile(
        llm, lambda: llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False), path, 30
    )


def profile_full_batch(llm, num_seqs: int, prompt_len: int, path: Path) -> None:
    """Profile ten decode steps of `num_seqs` running requests (the throughput run's full batch):
    which kernels a large step's time goes to (attention, GEMMs, small ops, sampling)."""
    ids = [
        llm.add_request(
            [rand_token() for _ in range(prompt_len)], SamplingParams(temperature=0.6, max_tokens=400, ignore_eos=True)
        )
        for _ in range(num_seqs)
    ]
    try:
        while llm.stats().num_waiting or any(s.num_uncomputed_tokens > 1 for s in llm.scheduler.running):
            llm.step()
        for _ in range(3):
            llm.step()
        write_profile(llm, lambda: [llm.step() for _ in range(10)], path)
    finally:
        for rid in ids:
            llm.abort_request(rid)
        while llm.has_unfinished_requests():
            llm.step()


def gemv_rows() -> None:
    """One row per weight shape: cuBLAS vs the fastest Triton GEMV tile, in microseconds, at 1/2/4
    rows; then the decoder norms run apart vs inside the projection after them, at one row."""
    from engine.layers import gemv

    shapes: dict[tuple, list[str]] = {}
    timings = sorted(gemv.TIMINGS.items(), key=lambda kv: kv[0][:2] + kv[0][3:])
    for (n, k, _dtype, _bias, bucket), (cublas_ms, kernel_ms) in timings:
        kernel = f"{kernel_ms * 1000:.1f}" if kernel_ms is not None else "-"
        shapes.setdefault((n, k), []).append(f"{bucket}: {cublas_ms * 1000:.1f}/{kernel}")
    for (n, k), cells in shapes.items():
        row(f"matmul {n}x{k}, cuBLAS/GEMV us", "", ", ".join(cells) + " (rows: us)")
    from engine.layers import normed_gemv

    for (n, k, _dtype, _bias, silu_mul), (unfused_ms, fused_ms) in sorted(
        normed_gemv.TIMINGS.items(), key=lambda kv: kv[0][:2]
    ):
        fused = f"{fused_ms * 1000:.1f}" if fused_ms is not None else "-"
        ops = "add+norm, matmul" + (", silu*up" if silu_mul else "")
        row(
            f"norm+matmul {n}x{k}, separate/fused us", f"{unfused_ms * 1000:.1f}/{fused}", f"1 row: {ops} in one kernel"
        )


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n / sorted(times)[len(times) // 2]


class StepClock:
    """Times every engine step and counts garbage collections while active, to see where a
    generate-driven decode's time goes: inside steps, between them, or in collector pauses."""

    def __init__(self, llm):
        self.llm, self.steps, self.collections = llm, [], 0

    def _on_gc(self, phase, info):
        if phase == "stop" and info["generation"] == 2:
            self.collections += 1

    def __enter__(self):
        step = self.llm.step

        def timed_step():
            t = time.perf_counter()
            out = step()
            self.steps.append(time.perf_counter() - t)
            return out

        self.llm.step = timed_step
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        del self.llm.step  # back to the class's method
        gc.callbacks.remove(self._on_gc)

    def summary(self, total: float) -> str:
        steps = sorted(self.steps)
        return (
            f"{len(steps)} steps: median {1000 * steps[len(steps) // 2]:.2f} ms, max {1000 * steps[-1]:.1f} ms, "
            f"in steps {sum(steps):.2f} of {total:.2f} s, {self.collections} full GCs"
        )


def decode_tps(llm, prompt_len: int, new_tokens: int, batch: int) -> tuple[float, str]:
    """Decode tokens/s: (time of prompt + N tokens) - (time of prompt + 1 token), over N - 1 steps;
    and a note on the step times of the longer run."""
    prompts = [[rand_token() for _ in range(prompt_len)] for _ in range(batch)]

    def run(n):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    # Warm up both runs' paths. The first run prefills cold; every later one finds the prompt cached
    # and prefills only its last block, another prefill shape: Triton compiles a kernel variant for it
    # on first use (about half a second), which must not land inside the timed run.
    run(new_tokens)
    run(1)
    with StepClock(llm) as clock:
        t_full = run(new_tokens)
    t_one = run(1)
    return batch * (new_tokens - 1) / (t_full - t_one), clock.summary(t_full)


def set_async_scheduling(llm, on: bool) -> None:
    """Switch the engine's scheduling mode (a public attribute, read at every step), after reading
    back any step still in flight."""
    while llm.has_unfinished_requests():
        llm.step()
    llm.async_scheduling = on


def hf_decode_tps(model, prompt_len: int, new_tokens: int, batch: int, device: str) -> float:
    ids = torch.randint(100, VOCAB[0], (batch, prompt_len), device=device)

    def run(n):
        sync(device)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t

    run(4)
    t_full, t_one = run(new_tokens), run(1)
    return batch * (new_tokens - 1) / (t_full - t_one)


@contextmanager
def section(name: str):
    """Run one benchmark; if it fails, say so in the table and go on with the next. A device run
    is rare and short: one broken measurement must not cost the others."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported in the table, with the traceback above it
        traceback.print_exc()
        row(f"{name}: FAILED", "", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        FAILURES.append(name)
    finally:
        release_memory()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 layers, tiny sizes: checks the script runs")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--num-requests", type=int, default=256)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    random.seed(0)
    torch.manual_seed(0)
    import transformers

    cfg = qwen3_06b_config(num_layers=2 if args.smoke else None)
    if args.smoke:
        cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size = 2048, 128, 256
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    VOCAB[0] = min(100000, cfg.vocab_size)
    folder = save_random_model(
        cfg,
        Path(tempfile.gettempdir()) / ("pagoda-smoke-qwen3" if args.smoke else "pagoda-qwen3-0.6b"),
        torch.bfloat16,
        device,
    )
    if device == "cuda":
        row("GPU", torch.cuda.get_device_name(), f"torch {torch.__version__}, transformers {transformers.__version__}")
    bandwidth = copy_bandwidth(device)
    row("copy bandwidth (read+write)", f"{bandwidth / 1e9:.0f} GB/s", "device-to-device copy, 1 GiB")

    small = args.smoke
    settings = dict(dtype="bfloat16", device=device, max_num_seqs=256 if not small else 8, gpu_memory_utilization=0.6)
    if small:
        settings["num_kvcache_blocks"] = 512
    n_new = 16 if small else 256
    prompt_len = 32 if small else 128
    batch64 = 64 if not small else 4
    got: dict[str, float] = {}  # figures later rows compare against

    llm = None
    with section("engine load"):
        llm = LLM(str(folder), **settings)
        stats = llm.stats()
        row(
            "attention backend",
            stats.attention_backend,
            f"KV blocks {stats.num_blocks}, matmul {stats.matmul}, sampler {stats.sampler}, "
            f"async scheduling {stats.async_scheduling}",
        )
        default_async = llm.async_scheduling
        gemv_rows()

    if llm is not None:
        with section("batch-1 decode"):  # graphs on, against the roofline
            tps1, steps1 = decode_tps(llm, prompt_len, n_new, 1)
            got["tps1"] = tps1
            weight_bytes = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
            kv_bytes = (
                llm.model_runner.kv_layout.bytes_per_block / llm.model_runner.block_size * (prompt_len + n_new / 2)
            )
            # A step reads the weights and the KV once. A copy moves 2 bytes (one read, one written) per
            # byte copied, and the copy bandwidth above counts both, so it is the rate of bytes read here.
            roofline = bandwidth / (weight_bytes + kv_bytes)
            row(
                "batch-1 decode, CUDA graphs",
                f"{tps1:.0f} tok/s",
                f"{100 * tps1 / roofline:.0f}% of roofline ({roofline:.0f} tok/s)",
            )
            row("batch-1 decode, its steps", "", steps1)
        with section("batch-1 decode, synchronous scheduling"):
            set_async_scheduling(llm, False)
            try:
                sync1, sync_steps1 = decode_tps(llm, prompt_len, n_new, 1)
            finally:
                set_async_scheduling(llm, default_async)
            note = f"async is {got['tps1'] / sync1:.2f}x; " if "tps1" in got else ""
            row("batch-1 decode, synchronous scheduling", f"{sync1:.0f} tok/s", note + sync_steps1)
        with section("batch-64 decode"):
            got["tps64"], _ = decode_tps(llm, prompt_len, n_new, batch64)
        with section("batch-1 decode step"):
            decode_breakdown(llm, prompt_len, args.json.parent if args.json else None)

        with section("TTFT"):  # a 2,000-token prompt cold, then with its first 1,900 tokens cached
            base = [rand_token() for _ in range(2000 if not small else 200)]
            other = base[: len(base) * 19 // 20] + [rand_token() for _ in range(len(base) // 20)]
            one = SamplingParams(temperature=0, max_tokens=1)
            sync(device)
            t0 = time.perf_counter()
            llm.generate([base], one, use_tqdm=False)
            sync(device)
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = llm.generate([other], one, use_tqdm=False)
            sync(device)
            warm = time.perf_counter() - t0
            row("TTFT 2,000-token prompt, cold", f"{cold * 1000:.1f} ms")
            row(
                "TTFT with 1,900 tokens cached",
                f"{warm * 1000:.1f} ms",
                f"{cold / warm:.1f}x faster, {out[0]['num_cached_tokens']} tokens from cache",
            )
            if args.json:  # where an eager prefill's time goes (host ops vs kernels), for the next round
                profile_prefill(llm, [rand_token() for _ in range(len(base))], args.json.parent / "profile_prefill.txt")

        # nano-vllm's workload
        n_req = args.num_requests if not small else 8
        lo, hi = (100, 1024) if not small else (10, 64)
        prompts = [[rand_token() for _ in range(random.randint(lo, hi))] for _ in range(n_req)]
        params = [
            SamplingParams(temperature=0.6, max_tokens=random.randint(lo, hi), ignore_eos=True) for _ in range(n_req)
        ]
        total_out = sum(p.max_tokens for p in params)

        def throughput() -> float:
            sync(device)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            sync(device)
            return time.perf_counter() - t0

        with section("throughput"):
            # Warm up what the timed run meets first: the sampler compiled for batches of 64+ rows with a
            # temperature (seconds on first use), and eager prefills whose block tables are a multiple
            # of 16 wide (Triton compiles a variant for such ints): 64 prompts of 16 blocks.
            warm_rows = 64 if not small else 4
            llm.generate(
                [[rand_token() for _ in range(250)] for _ in range(warm_rows)],
                SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True),
                use_tqdm=False,
            )
            with StepClock(llm) as clock:
                elapsed = throughput()
            got["throughput"] = total_out / elapsed
            row(
                f"throughput, {n_req} req, {lo}-{hi} in/out",
                f"{total_out / elapsed:.0f} tok/s",
                f"{total_out} output tokens in {elapsed:.1f} s, {llm.stats().num_preemptions} preemptions, "
                f"sampler {llm.stats().sampler}; {clock.summary(elapsed)}",
            )
        with section("throughput, synchronous scheduling"):
            set_async_scheduling(llm, False)
            sync_elapsed = throughput()
            note = f"async is {got['throughput'] * sync_elapsed / total_out:.2f}x" if "throughput" in got else ""
            row("throughput, synchronous scheduling", f"{total_out / sync_elapsed:.0f} tok/s", note)
        if args.json:
            with section("profile of a full-batch decode step"):
                profile_full_batch(llm, n_req, 512 if not small else 32, args.json.parent / "profile_decode_full.txt")
        del llm
        release_memory()

    with section("eager decode"):  # graphs vs eager
        eager = LLM(str(folder), **settings, enforce_eager=True)
        eager_new = max(8, n_new // 4)  # a rate: fewer tokens suffice, and eager steps are slow
        try:
            e1, _ = decode_tps(eager, prompt_len, eager_new, 1)
            e64, _ = decode_tps(eager, prompt_len, eager_new, batch64)
        finally:
            del eager
        row(
            "batch-1 decode, eager",
            f"{e1:.0f} tok/s",
            f"graphs are {got['tps1'] / e1:.2f}x faster" if "tps1" in got else "",
        )
        row(
            f"batch-{batch64} decode, graphs / eager",
            f"{got.get('tps64', float('nan')):.0f} / {e64:.0f} tok/s",
            f"graphs are {got['tps64'] / e64:.2f}x faster" if "tps64" in got else "",
        )

    with section("transformers"):  # on the same GPU
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
        hf1 = hf_decode_tps(hf, prompt_len, 64 if not small else 8, 1, device)
        row(
            "transformers batch-1 decode",
            f"{hf1:.0f} tok/s",
            f"engine is {got['tps1'] / hf1:.1f}x faster" if "tps1" in got else "",
        )
        hf_batch = 32 if not small else 4
        hf_tp = hf_decode_tps(hf, 512 if not small else 32, 64 if not small else 8, hf_batch, device)
        row(
            f"transformers batch-{hf_batch} decode",
            f"{hf_tp:.0f} tok/s",
            f"static batch; engine throughput above is {got['throughput'] / hf_tp:.1f}x"
            if "throughput" in got
            else "static batch",
        )
        del hf

    print("\n| benchmark | value | note |\n|---|---:|---|")
    for name, value, note in ROWS:
        print(f"| {name} | {value} | {note} |")
    if args.json:
        args.json.write_text(json.dumps(ROWS, indent=1))
    if FAILURES:
        print(f"gpu_bench: {len(FAILURES)} benchmark(s) failed: {', '.join(FAILURES)}", file=sys.stderr)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
