"""Loading a GGUF file costs little more memory than the loaded model keeps (issue 38): a fresh process loads a
generated 88 MB file shaped like a llama.cpp Q4_K_M (Q4_K, with Q6_K for the tied table and half the attn_v and
ffn_down), and its peak resident memory above what its imports took is measured (bench/gguf_load_memory.py).

Before the fix the kernel chooser built every candidate kernel over each whole weight beside the weight
dequantized to float32, and the reader's memory map counted the file once more: this load added 1800 MB.
Now it adds 304-324 MB (six runs): the 174 MB of weights the model keeps, the 67 MB KV cache, and some 70 MB of
code pages and allocator slack.

What the model keeps is each weight in its fastest kernel's layout. With PyTorch's kernels alone that is Q4_K at
1.11x its stored size but Q6_K at 3x (HalvesSplitInt4Matmul, four 4-bit terms), so a Q4_K_M file's weights took
about 2x the file. The K-quant kernel (engine/quantization/kquant.py) holds Q4_K, Q5_K and Q6_K in their GGUF blocks,
and the load keeps them so throughout (engine/quantization/blocks.py): the load then adds 219 MB (1.41x the file
and KV cache; 1.16x for a 473 MB file of the same mix, where the fixed code pages weigh less). Where that kernel can
be built, the load must stay within the issue's 1.15x of file and KV cache plus the allowance; elsewhere within
2.5x.
"""

import pytest
import torch

from bench.gguf_load_memory import measure_load
from engine.quantization import kquant
from engine.quantization.blocks import BlockWeight, UnreadBlocks
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
    report = (
        f"the load added {added / 1e6:.0f} MB over its imports; the model keeps {f['held_bytes'] / 1e6:.0f} MB "
        f"of weights and a {KV_BYTES / 1e6:.0f} MB KV cache; the file is {f['file_bytes'] / 1e6:.0f} MB"
    )
    assert added <= 1.15 * kept + ALLOWANCE, report
    if kquant.ops() is not None:  # the weights are held at the file's size
        assert f["held_bytes"] <= 1.15 * f["file_bytes"], report  # Q4_K in Int4PackMatmul, where faster: 1.11x
        assert added <= 1.15 * (f["file_bytes"] + KV_BYTES) + ALLOWANCE, report
    else:
        assert added <= 2.5 * (f["file_bytes"] + KV_BYTES), report


def test_the_shards_of_a_fused_weight_are_read_straight_into_its_buffer():
    """gate and up (q, k and v) were each read whole and then copied together: 2.8 s of a Llama-8B file's load, and
    each layer's pair held twice for a moment. Unread shards are now read into the fused buffer itself."""
    stored = [torch.randint(0, 256, (rows, 144), dtype=torch.uint8) for rows in (3, 5)]
    targets = []

    def reader(data):
        def read_into(out):
            targets.append(out)
            out.copy_(data)

        return read_into

    parts = [BlockWeight(UnreadBlocks(tuple(d.shape), reader(d)), "Q4_K", (len(d), 256), 4, 32, None) for d in stored]
    assert parts[0].to(torch.device("cpu")) is parts[0] and not targets  # nothing is read before it is needed
    fused = BlockWeight.concat(parts)
    assert torch.equal(fused.blocks, torch.cat(stored)) and fused.shape == (8, 256)
    start = fused.blocks.data_ptr()
    assert [t.data_ptr() - start for t in targets] == [0, 3 * 144]  # into the fused buffer, one after the other
