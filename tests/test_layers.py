"""The small fused ops against transformers' own, bit for bit in float32, and the CPU's packed matmuls."""

import pytest
import torch
from torch import nn

from engine.layers import linear as linear_mod
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear, pack_for_cpu
from engine.layers.rotary_embedding import RotaryEmbedding


def llama_module():
    # Imported in the test, not at collection: transformers imports triton, which must first see
    # the TRITON_INTERPRET=1 that tests/test_triton_attention.py sets.
    from transformers.models.llama import modeling_llama

    return modeling_llama


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers_bit_for_bit(dtype):
    modeling_llama = llama_module()
    torch.manual_seed(0)
    ours, theirs = RMSNorm(96, 1e-5).to(dtype), modeling_llama.LlamaRMSNorm(96, 1e-5).to(dtype)
    weight = torch.randn(96).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    for rows in (1, 7, 300):
        x, residual = (torch.randn(rows, 96) * 3).to(dtype), torch.randn(rows, 96).to(dtype)
        assert torch.equal(ours(x), theirs(x))
        normed, summed = ours(x, residual)
        assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))
    heads = torch.randn(5, 4, 96).to(dtype)  # Qwen3's per-head q/k norm
    assert torch.equal(ours(heads), theirs(heads))


def test_rotary_equals_transformers_bit_for_bit():
    modeling_llama = llama_module()
    torch.manual_seed(0)
    head_dim, positions = 64, torch.tensor([0, 1, 2, 5, 100, 511, 7])
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    rotary = RotaryEmbedding(head_dim, 512, params)
    q, k = torch.randn(7, 6, head_dim), torch.randn(7, 2, head_dim)
    got_q, got_k = rotary(positions, torch.cat((q, k), dim=1), 6).split([6, 2], dim=1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    # transformers' layout: q [batch, heads, tokens, head_dim], cos [batch, tokens, head_dim]
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


def test_partial_longrope_rotary_equals_transformers_phi3_on_each_side_of_the_pretraining_length():
    """Phi-4-mini's shape of rotary: 3/4 of each head rotated, LongRoPE. Within the pretraining length (128 here) the
    short factors, past it the long ones, each position as transformers rotates it in a forward that long."""
    import transformers
    from transformers.models.phi3 import modeling_phi3

    from engine.layers.rotary_embedding import rope_parameters

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.2 * i for i in range(12)],
        "long_factor": [3.0 + 0.5 * i for i in range(12)],
    }
    config = transformers.Phi3Config(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        rope_parameters={**rope, "original_max_position_embeddings": 128},
        pad_token_id=0,
        vocab_size=16,
    )
    rotary = RotaryEmbedding(32, 512, rope_parameters(config))
    hf_rotary = modeling_phi3.Phi3RotaryEmbedding(config)
    torch.manual_seed(1)
    for positions in (torch.tensor([0, 3, 77, 127]), torch.tensor([128, 300, 511])):
        q, k = torch.randn(len(positions), 4, 32), torch.randn(len(positions), 2, 32)
        got_q, got_k = rotary(positions, torch.cat((q, k), dim=1), 4).split([4, 2], dim=1)
        cos, sin = hf_rotary(q, positions[None])  # the forward's longest position picks the factors
        want_q, want_k = modeling_phi3.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        assert torch.equal(got_q[..., 24:], q[..., 24:])  # the last quarter of each head is not rotated


@pytest.mark.parametrize("k_eps", [1e-6, 1e-5], ids=["one_eps", "two_eps"])  # real configs share one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_then_rotary_equals_transformers_bit_for_bit(dtype, k_eps):
    """Qwen3: each head of q and k normalised (each by its own norm, with its own epsilon), then
    rotated, in one call over both (one kernel in the graphs)."""
    modeling_llama = llama_module()
    torch.manual_seed(0)
    head_dim, positions = 32, torch.tensor([3, 0, 40, 9])
    rotary = RotaryEmbedding(head_dim, 64, {"rope_theta": 1000000.0, "rope_type": "default"})
    q_norm, k_norm = RMSNorm(head_dim, 1e-6).to(dtype), RMSNorm(head_dim, k_eps).to(dtype)
    q_norm.weight.data.copy_(torch.randn(head_dim))
    k_norm.weight.data.copy_(torch.randn(head_dim))
    q, k = torch.randn(4, 4, head_dim).to(dtype), torch.randn(4, 1, head_dim).to(dtype)
    got_q, got_k = rotary(positions, torch.cat((q, k), dim=1), 4, q_norm, k_norm).split([4, 1], dim=1)
    hf_q = modeling_llama.LlamaRMSNorm(head_dim, 1e-6).to(dtype)
    hf_k = modeling_llama.LlamaRMSNorm(head_dim, k_eps).to(dtype)
    hf_q.weight.data.copy_(q_norm.weight)
    hf_k.weight.data.copy_(k_norm.weight)
    inv_freq = 1.0 / (1000000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    emb = torch.cat([torch.outer(positions.float(), inv_freq)] * 2, dim=-1)
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(
        hf_q(q).transpose(0, 1)[None],
        hf_k(k).transpose(0, 1)[None],
        emb.cos()[None].to(dtype),
        emb.sin()[None].to(dtype),
    )
    assert torch.equal(got_q, want_q[0].transpose(0, 1)) and torch.equal(got_k, want_k[0].transpose(0, 1))


class TinyTied(nn.Module):
    """Every kind of layer pack_for_cpu handles, with the head sharing the embedding's table."""

    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(50, 16)
        self.qkv = ColumnParallelLinear.split(16, [24, 8], bias=True)
        self.out = RowParallelLinear(32, 16, bias=True)
        self.head = ParallelLMHead(50, 16)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.out(self.qkv(self.embed(ids))))


def tiny_tied() -> TinyTied:
    torch.manual_seed(0)
    model = TinyTied()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_packed_matmuls_match_plain_ones_and_drop_the_plain_weights():
    model = tiny_tied()
    ids = torch.tensor([3, 0, 49, 7])
    with torch.inference_mode():
        plain = model(ids)
        assert linear_mod.can_pack_for_cpu(torch.float32)
        pack_for_cpu(model)
        packed = model(ids)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-4)
    assert model.qkv.weight is None and model.out.weight is None  # no second copy of the weights
    assert model.embed.weight is not None  # the tied table still serves lookups
    assert isinstance(model.head.kernel, linear_mod.OneDNNMatmul)
    assert "(kernel): OneDNNMatmul(16 -> 32, torch.float32)" in repr(model.qkv)  # print(model) shows the swap


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_packed_matmuls_ask_onednn_for_few_row_counts_and_keep_every_row(monkeypatch):
    """oneDNN caches a kernel per row count (~0.6 MiB each, up to 1,024): a server's RSS climbed with every
    new step size. Rows go to it rounded up to 72 sizes up to 2,048, at most 1/8 more; results are unchanged."""
    asked = []
    pointwise = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        linear_mod.torch.ops.mkldnn,
        "_linear_pointwise",
        lambda x, *rest: (asked.append(x.shape[0]), pointwise(x, *rest))[1],
        raising=False,
    )
    weight = torch.randn(24, 40)
    kernel = linear_mod.OneDNNMatmul(weight)
    for rows in (1, 7, 16, 17, 100, 300, 2047):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(kernel(x, None, None), x @ weight.T, rtol=1e-5, atol=1e-4)
    assert asked == [1, 7, 16, 18, 104, 320, 2048]
    sizes = {linear_mod.bucketed_rows(r) for r in range(1, 2049)}
    assert len(sizes) == 72 and all(r <= linear_mod.bucketed_rows(r) <= 1.125 * r for r in range(1, 2049))


def test_without_onednn_support_for_the_dtype_the_engine_keeps_plain_weights(monkeypatch, tiny_llama):
    from engine import LLM

    def refuse(*args, **kwargs):
        raise RuntimeError("mkldnn_reorder_linear_weight: unsupported on this CPU")

    monkeypatch.setattr(linear_mod.torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert not linear_mod.can_pack_for_cpu(torch.float32)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kvcache_blocks=16)
    assert llm.stats().matmul == "torch"
    model = llm.model_runner.model
    assert model.lm_head.kernel is None and model.lm_head.weight is model.model.embed_tokens.weight
    out = llm.generate([[3, 4, 5]], use_tqdm=False)[0]  # still serves, on F.linear
    assert len(out["token_ids"]) > 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_engine_on_cpu_packs_its_weights_and_counts_the_tied_head_copy(tiny_llama):
    from engine import LLM
    from engine.loader import checkpoint_numel, safetensors_files

    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", num_kvcache_blocks=16)
    assert llm.stats().matmul == "onednn-packed"
    model = llm.model_runner.model
    assert model.lm_head.weight is None and model.model.embed_tokens.weight is not None  # tied: lookups keep a table
    checkpoint = checkpoint_numel(safetensors_files(tiny_llama)) * 4  # the table once: the checkpoint is tied
    vocab, hidden = model.model.embed_tokens.weight.shape
    assert llm.parameter_bytes() == [checkpoint + vocab * hidden * 4]
