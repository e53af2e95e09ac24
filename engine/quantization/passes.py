"""The quantization pass: swap a built model's linear layers, LM head and token embedding for
quantized modules, before its weights load (gpt-fast's quantize.py is the pattern).

The model is built on the meta device, so no full-precision weight is ever allocated: each
checkpoint tensor is quantized as it loads (engine/loader/weights.py), or, from a GGUF file,
arrives quantized already. `finalize` then picks each layer's kernel by measurement.
"""

from collections import Counter

import torch
from torch import nn

from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.fused_moe import Experts
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.quantization.kernels import DenseMatmul, QuantizedMatmul
from engine.quantization.methods import DEFAULT_GROUP_SIZE, check_method, head_method
from engine.quantization.modules import KernelTarget, QuantizedEmbedding, QuantizedLinear


def quantize(
    model: nn.Module, method: str | None, target: KernelTarget, group_size: int = DEFAULT_GROUP_SIZE
) -> nn.Module:
    """Swap the modules in place (and return the model). `method` None keeps full-precision tensors as
    they are and takes quantized ones (a GGUF file's) as they come. Each linear layer builds its
    kernels for `target` as soon as its tensors have loaded."""
    check_method(method)
    if method is not None and any(isinstance(m, Experts) for m in model.modules()):
        raise ValueError(
            f"quantization={method!r} does not cover mixture-of-experts layers yet, which hold most of this "
            "model's weights; load it without quantization"
        )
    for name, module in list(model.named_modules()):
        bias = getattr(module, "bias", None)
        if isinstance(module, Experts):  # experts from a GGUF file, which arrive quantized
            swapped = module.quantized(target)
        elif isinstance(module, ParallelLMHead):
            swapped = QuantizedLinear(
                module.embedding_dim, [module.num_embeddings], None, head_method(method), group_size, target
            )
        elif isinstance(module, VocabParallelEmbedding):
            # A tied table is stored as the head stores it, once; an untied embedding only has rows looked up.
            table = head_method(method) if getattr(model, "tie_word_embeddings", False) else method
            swapped = QuantizedEmbedding(module.num_embeddings, module.embedding_dim, table, group_size, target)
        elif isinstance(module, ColumnParallelLinear):
            swapped = QuantizedLinear(module.in_features, module.output_sizes, bias, method, group_size, target)
        elif isinstance(module, RowParallelLinear):
            swapped = QuantizedLinear(module.in_features, [module.out_features], bias, method, group_size, target)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, swapped)
    return model


def finalize(model: nn.Module) -> None:
    """Once every tensor has loaded: the linear layers have built their kernels already; the embedding
    goes last, so that it may share a tied head's codes."""
    head = getattr(model, "lm_head", None) if getattr(model, "tie_word_embeddings", False) else None
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding):
            module.finalize(head)


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the quantized modules and their kernels hold (they are plain attributes, in the
    layouts the kernels read, not parameters)."""
    holders = [m for m in model.modules() if isinstance(m, QuantizedMatmul | DenseMatmul | QuantizedEmbedding)]
    return [t for m in holders for t in vars(m).values() if isinstance(t, torch.Tensor)]


def kernel_summary(model: nn.Module) -> str:
    """The kernels the linear layers run and how many run each, e.g. "Int4PackMatmul x210"."""
    kernels = [m for m in model.modules() if isinstance(m, QuantizedMatmul | DenseMatmul)]
    # SplitInt4Matmul runs its terms as one Int4PackMatmul: count the kernel a layer chose, not its parts
    nested = {id(part) for m in kernels for part in m.modules() if part is not m}
    kinds = Counter(type(m).__name__ for m in kernels if id(m) not in nested)
    return ", ".join(f"{name} x{count}" for name, count in kinds.most_common())


def weight_types(model: nn.Module) -> str:
    """What the weights are stored as, e.g. "int4 (groups of 64)" or "Q4_1, Q8_0"."""
    sources = Counter(
        m.source for m in model.modules() if isinstance(m, QuantizedMatmul | QuantizedEmbedding) and m.source != "dense"
    )
    return ", ".join(sources) if sources else "none"
