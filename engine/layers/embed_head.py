"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks.

Rank r holds rows [r * per_rank, (r + 1) * per_rank) of the table. When the vocabulary does not
divide evenly, the last rank's tail is zero padding that no token id reaches and whose logits are
cut off. The head may share its table with the embedding (tied embeddings): both split alike.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import PackableLinear
from engine.runner.distributed import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.per_rank = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))  # filled by the loader

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"the checkpoint gives shape {tuple(loaded.shape)}, "
                f"the model expects {(self.num_embeddings, self.embedding_dim)}"
            )
        rows = loaded[self.start : self.start + self.per_rank]
        param.data[: len(rows)].copy_(rows)
        param.data[len(rows) :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Each rank embeds the ids in its rows and zeros for the rest; the sum over ranks is the lookup.
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        x = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0; None on the other ranks (only rank 0 samples)."""
        logits = self.matmul(hidden)
        if self.tp.size == 1:
            return logits
        parts = self.tp.gather(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, : self.num_embeddings]
