"""Pagoda's K-quant CPU kernel (engine/quantization/kquant.py, issue 38): Q4_K, Q5_K and Q6_K multiplied straight
from the GGUF blocks, which the model then holds at the file's size.

- each kernel equals gguf-py's dequantized product: exactly (up to float32 sum order) once x is rounded per 256
  columns to int8 as the kernel rounds it, and within that rounding's bound of the unrounded product; float32
  activations to sum order; K-quants hold whole 256-column blocks, so K is a multiple of 256 (odd N, M up to 20,
  past the 16 rows one pass serves, and prefill's tiled path)
- its dequantization equals gguf-py's bit for bit, and the tied table's rows are read from it
- a Q6_K file's greedy output equals its dequantized float32 model's, and its Q6_K weights are held at file size
- without a compiler the kernel is not offered, the log says so once, and PyTorch's kernels serve
"""

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.quantization import kquant
from engine.quantization.layout import QuantizedWeight

pytestmark = pytest.mark.skipif(kquant.ops() is None, reason="the K-quant kernel cannot be built here")

TYPES = ("Q4_K", "Q5_K", "Q6_K")
# (N, K, M): odd N, K of one and of several blocks, one row (decode), a few, more than one pass serves
SHAPES = [(7, 256, 1), (33, 768, 3), (5, 1280, 16), (17, 512, 20)]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes with small finite fp16 scales (and mins), [rows, row bytes]."""
    rng = np.random.default_rng(seed)
    n = rows * cols // kquant.BLOCK_VALUES[type_name]
    blocks = rng.integers(0, 256, size=(n, kquant.BLOCK_BYTES[type_name]), dtype=np.uint8)
    if type_name == "MXFP4":  # exponents around 2^0, subnormal ones included: 2^-128 and 2^-127
        blocks[:, 0] = rng.integers(118, 136, n)
        blocks[: min(n, 2), 0] = (0, 1)[: min(n, 2)]
        return blocks.reshape(rows, -1)
    for at in {"Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,)}.get(type_name, (0, 2)):
        halves = (rng.uniform(1e-3, 1e-2, n) * rng.choice([-1, 1], n)).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


def weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A QuantizedWeight as the loader makes it (codes and the blocks), and gguf-py's dequantization of it."""
    from engine.loader.gguf_blocks import decode

    stored = random_blocks(type_name, n, k, seed)

    class Bytes:
        size = stored.size

        def read(self, start, stop):
            return torch.from_numpy(stored.reshape(-1)[start:stop].copy())

        def read_into(self, out, start=0):
            out.view(-1).copy_(self.read(start, start + out.numel()))

    qw = decode(Bytes(), type_name, (n, k))
    return qw, torch.from_numpy(gguf.dequantize(stored, T[type_name])).float()


def rounded_to_int8(x: torch.Tensor, columns: int = 256) -> torch.Tensor:
    """x as the kernel rounds it: int8 steps of (the largest |x| of each `columns` columns) / 127."""
    blocks = x.view(x.shape[0], -1, columns)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / step) * step).view_as(x)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n,k,m", SHAPES)
def test_kernel_equals_the_dequantized_product(type_name, n, k, m):
    qw, w = weight(type_name, n, k, seed=n + k)
    assert qw.blocks is not None and torch.equal(qw.dequantize(), w)  # the loader keeps the blocks it decoded
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    exact = x.double() @ w.double().T
    scale = exact.abs().max().item()
    kernel = kquant.KQuantMatmul(qw, torch.float32, act="int8")
    y = kernel.ops.kquant_mm(x, kernel.blocks, kernel.kind, 0)
    # exact once x is rounded as the kernel rounds it, but for float32 sum order
    assert (y.double() - rounded_to_int8(x).double() @ w.double().T).abs().max().item() <= 1e-5 * scale
    # and within that rounding of the exact product: each column moves by at most half a step
    bound = (w.double().abs() @ (x - rounded_to_int8(x)).double().abs().T).T  # |W| |dx|, a column's share
    assert ((y.double() - exact).abs() <= bound + 1e-5 * scale).all()
    f32 = kquant.KQuantMatmul(qw, torch.float32, act="f32")
    assert (f32(x).double() - exact).abs().max().item() <= 1e-5 * scale


# Q8_0, MXFP4, Q4_0 and Q4_1: K any multiple of 32 (the unsigned kinds' rows take blocks in pairs: an odd count
# leaves one), x rounded per 32 columns; the unsigned kinds serve 8 rows of x a pass
Q8_0_SHAPES = [(7, 32, 1), (33, 96, 1), (33, 96, 3), (5, 576, 16), (17, 800, 20)]
BLOCK32_TYPES = ["Q8_0", "MXFP4", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("n,k,m", Q8_0_SHAPES)
@pytest.mark.parametrize("type_name", BLOCK32_TYPES)
def test_32_value_block_kernels_equal_the_dequantized_product(type_name, n, k, m, isa):
    if kquant.ops(isa) is None:
        pytest.skip(f"the {isa} build cannot be made here")
    qw, w = weight(type_name, n, k, seed=n + k)
    assert qw.blocks is not None and torch.equal(qw.dequantize(), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    kernel = kquant.KQuantMatmul(qw, torch.float32, isa=isa)
    y = kernel(x).double()
    exact = x.double() @ w.double().T
    want = rounded_to_int8(x, 32).double() @ w.double().T
    assert (y - want).abs().max().item() <= 1e-5 * exact.abs().max().item()
    assert torch.equal(kernel.looked_up_rows(torch.tensor([n - 1, 0])), w[[n - 1, 0]])


@pytest.mark.parametrize("type_name", [*TYPES, *BLOCK32_TYPES])
def test_a_row_gets_the_same_product_alone_and_among_others(type_name):
    """Bit for bit, at 1 to 19 rows (one pass, several, a part pass): speculative decoding checks drafts as rows of
    one step and must get what plain decode steps, one row each, get."""
    k = 512 if type_name in TYPES else 96
    qw, _ = weight(type_name, 9, k, seed=5)
    kernel = kquant.KQuantMatmul(qw, torch.float32)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([kernel(x[i : i + 1]) for i in range(len(x))])
    for m in (2, 3, 8, 9, 19):
        assert torch.equal(kernel(x[:m]), alone[:m]), m


@pytest.mark.parametrize("type_name", TYPES)
def test_prefill_tiles_and_looked_up_rows(type_name, monkeypatch):
    qw, w = weight(type_name, 29, 512, seed=3)
    kernel = kquant.KQuantMatmul(qw, torch.float32)
    monkeypatch.setattr(kernel, "tile_rows", 8)  # several tiles, the last one short
    kernel.dense_from_rows = 16
    x = torch.randn(19, 512)
    exact = x @ w.T
    assert (kernel(x) - exact).abs().max().item() <= 0.02 * exact.abs().max().item()  # bf16 tiles
    assert torch.equal(kernel.dequantized_bf16(), w.to(torch.bfloat16))
    ids = torch.tensor([0, 28, 5, 5])
    assert torch.equal(kernel.looked_up_rows(ids), w[ids])
    assert torch.equal(kquant.dequantize_blocks(qw.blocks, type_name), w)


def test_compiled_graphs_call_it():
    """Decode steps are compiled graphs: the kernel and a tied table's row lookup run inside one."""
    qw, w = weight("Q6_K", 9, 512, seed=7)
    kernel = kquant.KQuantMatmul(qw, torch.float32)
    step = torch.compile(lambda ids, x: kernel(x) + kernel.looked_up_rows(ids)[:, :9], fullgraph=True, backend="eager")
    ids, x = torch.tensor([1, 4]), torch.randn(2, 512)
    assert torch.allclose(step(ids, x), kernel(x) + w[ids][:, :9])


def test_the_chooser_takes_it_and_holds_the_file_size():
    from engine.quantization.chooser import choose_matmul

    qw, _ = weight("Q6_K", 96, 1024, seed=5)
    kernel = choose_matmul(qw, torch.device("cpu"), torch.float32)
    assert isinstance(kernel, kquant.KQuantMatmul), type(kernel).__name__
    held = sum(t.numel() * t.element_size() for t in vars(kernel).values() if isinstance(t, torch.Tensor))
    assert held == 96 * 1024 // 256 * 210


def test_a_q6_k_file_replies_as_its_dequantized_model(tmp_path):
    """Greedy output of a small Q6_K GGUF over 16 tokens equals its dequantized float32 folder's."""
    from tests.conftest import build_tokenizer
    from tests.test_gguf_engine import dequantized_folder, greedy, hf_model, make_llm, prompt_ids, write_model_gguf

    build_tokenizer(tmp_path / "tok")
    model = hf_model("qwen3")
    path = write_model_gguf(
        tmp_path / "model.gguf", "qwen3", model, {"linear": "Q6_K", "embed": "Q6_K"}, tmp_path / "tok"
    )
    reference = make_llm(dequantized_folder(path, model, tmp_path / "tok", tmp_path / "reference"))
    llm = make_llm(path)
    assert "KQuantMatmul" in llm.stats().matmul, llm.stats().matmul
    prompts = [prompt_ids(2), prompt_ids(3, 7)]
    for got, want in zip(greedy(llm, prompts, max_tokens=16), greedy(reference, prompts, max_tokens=16)):
        assert got["token_ids"] == want["token_ids"]


def test_compiled_decode_steps_agree_with_eager_ones(tmp_path, monkeypatch):
    """A Q4_K_M-like file's decode steps compiled (the kernel and the table's lookup inside the graph) agree with the
    eager steps, and greedy output is the eager engine's."""
    from engine.runner import compiled_decode
    from tests.conftest import build_tokenizer
    from tests.test_gguf_engine import greedy, hf_model, make_llm, prompt_ids, write_model_gguf

    build_tokenizer(tmp_path / "tok")
    types = {"linear": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q5_K", "embed": "Q6_K"}
    path = write_model_gguf(tmp_path / "model.gguf", "qwen3", hf_model("qwen3"), types, tmp_path / "tok")
    eager = make_llm(path)
    monkeypatch.setenv(compiled_decode.ENV_SWITCH, "1")
    compiled = make_llm(path)
    assert compiled.model_runner.wait_for_compiled_decode(timeout=600)
    notes = "; ".join(compiled.model_runner.compiled_decode.notes)
    assert "KQuantMatmul" in compiled.stats().matmul and "disagrees" not in notes, notes
    prompts = [prompt_ids(4), prompt_ids(5, 9)]
    for got, want in zip(greedy(compiled, prompts, max_tokens=12), greedy(eager, prompts, max_tokens=12)):
        assert got["token_ids"] == want["token_ids"]


NO_COMPILER = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from engine.quantization import kquant
from engine.quantization.chooser import candidates
from tests.test_kquant import weight
assert kquant.ops() is None and kquant.ops() is None
qw, _ = weight("Q6_K", 8, 256)
names = candidates(qw, torch.device("cpu"), torch.float32)
assert "KQuantMatmul" not in names and "HalvesSplitInt4Matmul" in names, names
print("OK")
"""


def test_without_a_compiler_pytorch_kernels_serve_and_the_log_says_so_once(tmp_path):
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-compiler"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "PYTHONPATH": os.getcwd(),
    }
    done = subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "K-quant CPU kernel could not be built" in line]
    assert len(said) == 1, done.stderr[-2000:]


@pytest.mark.parametrize("type_name", TYPES)
def test_the_avx2_build_equals_the_dequantized_product(type_name):
    """The AVX2-only build (PAGODA_KQUANT_ISA=avx2, for AVX2 machines) runs its own fused loop."""
    if kquant.ops("avx2") is None:
        pytest.skip("the AVX2 build cannot be made here")
    for n, k, m in SHAPES:
        qw, w = weight(type_name, n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        kernel = kquant.KQuantMatmul(qw, torch.float32, isa="avx2")
        y = kernel.ops.kquant_mm(x, kernel.blocks, kernel.kind, 0).double()
        want = rounded_to_int8(x).double() @ w.double().T
        assert (y - want).abs().max().item() <= 1e-5 * want.abs().max().item()
