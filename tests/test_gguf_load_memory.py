"""Loading a GGUF file costs little more memory than the loaded model keeps (issue 38): a fresh process loads a
generated 88 MB file shaped like a llama.cpp Q4_K_M (Q4_K, with Q6_K for the tied table and half the attn_v and
ffn_down), and its peak resident memory above what its imports took is measured (bench/gguf_load_memory.py).

Before the fix the kernel chooser built every candidate kernel over each whole weight beside the weight
dequantized to float32, and the reader's memory map counted the file once more: this load added 1800 MB.
Now it adds 304-324 MB (six runs): the 174 MB of weights the model keeps, the 67 MB KV cache, and some 70 MB of
code pages and allocator slack.

What the model keeps is each weight in its fastest kernel's layout: Q4_K at 1.11x its stored size, but Q6_K at
3x (HalvesSplitInt4Matmul, four 4-bit terms), so a Q4_K_M file's weights take about 2x the file. The issue's
goal of 1.15x the file for the whole load needs a Q6_K kernel with a compact layout; until then this checks the
load against what the model keeps (1.15x, plus the allowance), and the file ratio against the layouts' 2x.
"""
import pytest

from bench.gguf_load_memory import measure_load
from tests.conftest import build_tokenizer
from tests.shaped_gguf import SMALL, write_shaped_gguf

KV_BYTES = 64 << 20
ALLOWANCE = 96 << 20  # code pages the load maps in (oneDNN's, the int4 kernels') and the allocator's slack


@pytest.fixture(scope="module")
def small_q4_k_m(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shaped")
    build_tokenizer(folder)
    return write_shaped_gguf(folder / "small-q4_k_m.gguf", SMALL, folder)


@pytest.mark.timeout(300)
def test_loading_a_gguf_takes_little_more_than_the_model_keeps(small_q4_k_m):
    f = measure_load(small_q4_k_m, KV_BYTES, threads=1)
    added, kept = f["peak_bytes"] - f["baseline_bytes"], f["held_bytes"] + KV_BYTES
    report = (f"the load added {added / 1e6:.0f} MB over its imports; the model keeps {f['held_bytes'] / 1e6:.0f} MB "
              f"of weights and a {KV_BYTES / 1e6:.0f} MB KV cache; the file is {f['file_bytes'] / 1e6:.0f} MB")
    assert added <= 1.15 * kept + ALLOWANCE, report
    assert added <= 2.5 * (f["file_bytes"] + KV_BYTES), report
