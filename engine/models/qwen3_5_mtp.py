"""The multi-token-prediction (MTP) head that Qwen3.5, Qwen3.6 and Qwen3-Next checkpoints ship beside the model
(their `mtp.*` tensors): the drafter of speculative decoding, which proposes the token after next from the model's
last hidden state and the next token's embedding:

    h = fc(concat(norm_embedding(embed(next token)), norm_hidden(hidden)))
    h = a full-attention decoder layer of the model's own kind (experts in the MoE models), then norm

and reads logits through the model's head. The model itself never runs it: loading a checkpoint skips these tensors
(they take no memory), and `load_mtp_head` builds the head and loads them when a drafter is wanted. Its attention
layer is not bound to a KV cache here; whoever runs the head gives it one.
"""

from pathlib import Path

import torch
from torch import nn

from engine.attention import AttentionMetadata
from engine.layers.linear import ColumnParallelLinear
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.gemma3 import GemmaRMSNorm

MTP_PREFIX = "mtp."


def mtp_layer_count(config) -> int:
    """The head's decoder layers, as the checkpoint's config names them (Qwen3.5: mtp_num_hidden_layers; Qwen3-Next:
    num_nextn_predict_layers)."""
    return int(getattr(config, "mtp_num_hidden_layers", 0) or getattr(config, "num_nextn_predict_layers", 0) or 1)


class MultiTokenPredictor(nn.Module):
    def __init__(self, model: nn.Module, config):
        from engine.models.qwen3_5 import Qwen3_5DecoderLayer  # the model's file imports this one's name

        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.fc = ColumnParallelLinear.split(2 * size, [size])
        self.pre_fc_norm_embedding = GemmaRMSNorm(size, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(size, eps)
        rotary: RotaryEmbedding = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
        first = config.num_hidden_layers  # numbered after the model's layers, as vLLM numbers them
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, first + i, rotary, kind="full_attention")
            for i in range(mtp_layer_count(config))
        )
        for layer in self.layers:  # the model's rotary table is not the head's to build, move or quantize
            del layer.self_attn.rotary
            layer.self_attn.__dict__["rotary"] = rotary
        self.norm = GemmaRMSNorm(size, eps)
        self.packed_modules = model.packed_modules
        # The model's embedding and head serve the head too: plain attributes, not parameters of its own
        self.__dict__["embed_tokens"] = model.model.embed_tokens
        self.__dict__["lm_head"] = model.lm_head
        self.hidden_in: torch.Tensor | None = None  # each row's hidden input, set before every call (mtp.py)

    static_decode = False  # its steps take `hidden_in` beside the token ids: never captured or compiled

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each row's hidden state for predicting the token after its input token, from that token's embedding and
        the row's `hidden_in`: the hidden state that predicted the input token (the model's, or this head's own for
        a token it drafted)."""
        embedded = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat((embedded, self.pre_fc_norm_hidden(self.hidden_in)), dim=-1))
        for layer in self.layers:
            x = layer(positions, x, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def load_mtp_head(model: nn.Module, config, source, target=None) -> MultiTokenPredictor:
    """The MTP head of the checkpoint `source`, whose model (with config `config`) `model` is. `source`: a
    safetensors checkpoint's folder, whose `mtp.*` tensors are read alone, the head built on the device and in the
    dtype of `model`'s weights; or a GGUFCheckpoint, whose blocks after the model's are the head, built on the meta
    device and swapped for quantized layers as a GGUF model is, to run on `target` (a quantization.KernelTarget).
    A checkpoint without a head gets a ValueError that says so."""
    from engine import quantization  # the loader and quantization import the models
    from engine.loader.gguf import GGUFCheckpoint
    from engine.loader.weights import load_tensors, read_tensors, safetensors_files

    config = getattr(config, "text_config", config)
    gguf = source if isinstance(source, GGUFCheckpoint) else None
    if gguf is None:
        weight = model.model.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        tensors = (
            (name.removeprefix(MTP_PREFIX), tensor)
            for file in safetensors_files(Path(source))
            for name, tensor in read_tensors(file, MTP_PREFIX)
        )
    else:
        device, dtype = target.device, target.dtype
        tensors, source = gguf.mtp_tensors(), gguf.path
    with torch.device("meta" if gguf is not None else device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = MultiTokenPredictor(model, config)
        finally:
            torch.set_default_dtype(default)
    found = iter(tensors)
    first = next(found, None)
    if first is None:
        stored = "no blocks after the model's" if gguf is not None else f"no {MTP_PREFIX}* tensors"
        raise ValueError(
            f"the checkpoint {source} has no multi-token-prediction head ({stored}); for speculative decoding use "
            '{"method": "ngram"} or a draft model instead'
        )
    if gguf is not None:
        quantization.quantize(head, None, target)
        head.to_empty(device=device)
    load_tensors(head, (t for part in ([first], found) for t in part), f"{source} (its multi-token-prediction head)")
    if gguf is not None:
        quantization.finalize(head)
    return head.eval()
