"""The fused add + RMSNorm + GEMV (+ SiLU-and-mul) kernel against the unfused layers, on CPU via
Triton's interpreter; the choice between them with a scripted timer; and a decoder run with it."""

import os

# Must be set before the kernels are imported, or they would try to compile for a GPU.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")
import torch  # noqa: E402

from engine.layers import normed_gemv as normed_module  # noqa: E402
from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.layernorm import RMSNorm  # noqa: E402
from engine.layers.linear import ColumnParallelLinear  # noqa: E402
from engine.layers.normed_gemv import choose_normed, normed_gemv, normed_tile_candidates  # noqa: E402


def fp16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).half()


def layer_and_norm(n: int, k: int, bias: bool, seed: int = 0):
    layer = ColumnParallelLinear.split(k, [n], bias=bias).half()
    norm = RMSNorm(k, eps=1e-6).half()
    with torch.no_grad():
        layer.weight.copy_(fp16(n, k, seed=seed, scale=0.05))
        if bias:
            layer.bias.copy_(fp16(n, seed=seed + 1, scale=0.5))
        norm.weight.copy_(1 + fp16(k, seed=seed + 2, scale=0.2))
    return layer, norm


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within a few fp16 steps: the fused kernel scales after the dot products and rounds once,
    where the layers round the normed row to fp16 before them."""
    return bool(((got.float() - expected.float()).abs() <= expected.float().abs() * 4e-3 + 4e-3).all())


@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
# N off the tile; K a whole number of chunks, whole chunks then a partial one, and only a partial one
@pytest.mark.parametrize("n,k", [(38, 1024), (22, 1300), (20, 300)])
def test_matches_the_unfused_layers_on_every_tile(n, k, with_bias, with_residual, silu_mul):
    layer, norm = layer_and_norm(n, k, with_bias)
    act = SiluAndMul() if silu_mul else None
    x = fp16(1, k, seed=5)
    residual = fp16(1, k, seed=6) if with_residual else None
    with torch.no_grad():
        expected, expected_residual = layer.normed_unfused(x, residual, norm, act)
        for tile in normed_tile_candidates(silu_mul):
            got, got_residual = normed_gemv(
                x, residual, norm.weight, norm.eps, layer.weight, layer.bias, *tile, silu_mul=silu_mul
            )
            assert got.shape == expected.shape == (1, n // 2 if silu_mul else n) and got.dtype == torch.float16
            assert close(got, expected), (tile, (got.float() - expected.float()).abs().max())
            # The residual stream is carried exactly: it is the model's memory across layers.
            assert torch.equal(got_residual, expected_residual), tile
            if residual is None:
                assert got_residual is x


def test_the_layer_runs_the_fused_kernel_only_at_one_row():
    layer, norm = layer_and_norm(24, 256, bias=False)
    layer.normed_kernel = normed_module.NormedGemv((4, 512))
    calls = []
    real = normed_module.normed_gemv

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    normed_module.normed_gemv, saved = spy, normed_module.normed_gemv
    try:
        with torch.no_grad():
            for rows in (1, 2):
                x, residual = fp16(rows, 256, seed=rows), fp16(rows, 256, seed=10 + rows)
                got, got_residual = layer.normed(x, residual, norm)
                expected, expected_residual = layer.normed_unfused(x, residual, norm)
                assert close(got, expected) and torch.equal(got_residual, expected_residual)
    finally:
        normed_module.normed_gemv = saved
    assert calls == [1]


def test_refuses_what_it_cannot_compute():
    layer, norm = layer_and_norm(24, 256, bias=False)
    with pytest.raises(ValueError, match="one row"):
        normed_gemv(fp16(2, 256, seed=0), None, norm.weight, 1e-6, layer.weight, None, 4, 512)
    with pytest.raises(ValueError, match="one row"):
        normed_gemv(fp16(1, 256, seed=0).float(), None, norm.weight, 1e-6, layer.weight, None, 4, 512)
    with pytest.raises(ValueError, match="even row count"):
        normed_gemv(fp16(1, 256, seed=0), None, norm.weight, 1e-6, layer.weight[:23], None, 4, 512, silu_mul=True)


def test_tiles_keep_within_the_register_budget():
    assert normed_tile_candidates(False) == [(2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (16, 256)]
    assert normed_tile_candidates(True) == [(2, 512), (2, 1024), (4, 256), (4, 512), (8, 256)]


class ScriptedTimer:
    """Times the unfused ops as `unfused_ms` and the fused kernel as `fused_ms`."""

    def __init__(self, unfused_ms: float, fused_ms: float):
        self.unfused_ms, self.fused_ms, self.calls = unfused_ms, fused_ms, 0

    def __call__(self, fn) -> float:
        self.calls += 1
        return self.fused_ms if "normed_gemv" in fn.__code__.co_names else self.unfused_ms


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(normed_module, "_CHOICES", {})


def test_choose_takes_the_fused_kernel_only_where_clearly_faster():
    qkv, norm = layer_and_norm(48, 256, bias=True)
    gate_up, post_norm = layer_and_norm(64, 256, bias=False, seed=3)
    pairs = [(qkv, norm, None), (gate_up, post_norm, SiluAndMul())]
    with torch.no_grad():
        assert choose_normed(pairs, ScriptedTimer(unfused_ms=1.0, fused_ms=0.5)) == 2
    assert qkv.normed_kernel.tile in normed_tile_candidates(False)
    assert gate_up.normed_kernel.tile in normed_tile_candidates(True)
    assert "(normed_kernel): NormedGemv(tile=" in repr(qkv)  # print(model) shows the swap

    normed_module._CHOICES.clear()
    with torch.no_grad():
        assert choose_normed(pairs, ScriptedTimer(unfused_ms=1.0, fused_ms=0.95)) == 0
    assert qkv.normed_kernel is None and gate_up.normed_kernel is None


def test_choose_measures_each_shape_once_and_skips_float32():
    layers = [layer_and_norm(48, 256, bias=False, seed=s) for s in (0, 10)]
    fp32_layer, fp32_norm = layer_and_norm(48, 256, bias=False, seed=20)
    fp32_layer.float()
    fp32_norm.float()
    timer = ScriptedTimer(unfused_ms=1.0, fused_ms=0.5)
    with torch.no_grad():
        choose_normed([(layer, norm, None) for layer, norm in layers] + [(fp32_layer, fp32_norm, None)], timer)
    assert timer.calls == 1 + len(normed_tile_candidates(False))
    assert layers[0][0].normed_kernel.tile == layers[1][0].normed_kernel.tile
    assert fp32_layer.normed_kernel is None


def test_choose_never_takes_a_kernel_that_disagrees(monkeypatch):
    layer, norm = layer_and_norm(48, 256, bias=False)
    real = normed_module.normed_gemv

    def off_by_one(*args, **kwargs):
        out, residual = real(*args, **kwargs)
        return out + 1, residual

    monkeypatch.setattr(normed_module, "normed_gemv", off_by_one)
    with torch.no_grad():
        assert choose_normed([(layer, norm, None)], ScriptedTimer(unfused_ms=1.0, fused_ms=0.1)) == 0
    assert layer.normed_kernel is None


def test_a_decoder_with_every_norm_fused_gives_the_same_tokens_and_close_logits(tiny_llama, monkeypatch):
    """The engine in half precision, with the kernel forced on for every q/k/v and gate/up: the
    decoder hands each norm to the right projection and carries the residual through."""
    from engine import LLM, SamplingParams
    from engine.runner import model_runner

    monkeypatch.setattr(model_runner, "can_pack_for_cpu", lambda dtype: False)  # keep the plain weights
    llm = LLM(str(tiny_llama), dtype="float16", num_kvcache_blocks=32, max_num_seqs=2, enable_prefix_caching=False)
    model = llm.model_runner.model
    logits_by_row = []
    real_logits = model.compute_logits
    monkeypatch.setattr(
        model, "compute_logits", lambda hidden: logits_by_row.append(real_logits(hidden)) or logits_by_row[-1]
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [5, 17, 33, 100, 7, 9]
    unfused = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    unfused_logits, logits_by_row[:] = list(logits_by_row), []
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.qkv_proj.normed_kernel = normed_module.NormedGemv((8, 512))  # widest: fewest programs
        layer.mlp.gate_up_proj.normed_kernel = normed_module.NormedGemv((4, 512))
    calls = []
    real = normed_module.normed_gemv
    monkeypatch.setattr(normed_module, "normed_gemv", lambda *a, **kw: calls.append(kw["silu_mul"]) or real(*a, **kw))
    fused = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    assert calls.count(False) == calls.count(True) == 3 * len(layers)  # the 3 one-row (decode) steps
    assert fused == unfused
    # Rounding differs in every layer (the kernel rounds once, after the dot products), so the
    # logits agree to a percent of their range; a norm applied to the wrong tensor would be far off.
    for before, after in zip(unfused_logits, logits_by_row):
        assert (after.float() - before.float()).abs().max() <= 0.01 * before.float().abs().max()


def test_choose_skips_a_tile_this_gpu_cannot_run_and_says_so(monkeypatch, caplog):
    layer, norm = layer_and_norm(48, 256, bias=False)
    real = normed_module.normed_gemv

    def out_of_resources(x, residual, norm_weight, eps, weight, bias, block_n, block_k, silu_mul=False):
        if block_n == 2:
            raise RuntimeError("out of resources: shared memory\nmore detail")
        return real(x, residual, norm_weight, eps, weight, bias, block_n, block_k, silu_mul=silu_mul)

    monkeypatch.setattr(normed_module, "normed_gemv", out_of_resources)
    with torch.no_grad(), caplog.at_level("WARNING", logger="engine"):
        assert choose_normed([(layer, norm, None)], ScriptedTimer(unfused_ms=1.0, fused_ms=0.5)) == 1
    assert layer.normed_kernel is not None and layer.normed_kernel.tile[0] != 2
    assert (
        "fused norm+GEMV tile 2x1024 failed on (48, 256) and is not used: out of resources: shared memory"
        in caplog.text
    )
