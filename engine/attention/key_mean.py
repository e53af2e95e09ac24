"""Centred keys, for the KV-cache formats that lose the most on keys (fp8, int4; `KVFormat.centres_keys`).

The keys of a head share a large common vector: 60-70% of their energy on the bundled model. A per-token scale sized
for it leaves the part that differs between tokens only a few quantization levels, and that part is what tells one
key from another. So the cache stores each key less the head's mean key, and attention adds back exactly what that
took out of every score.

The mean is measured before the rotary embedding, where it is one vector at every position (`calibrate`, on a text
run through the model at load). After the embedding, the key at position n carries the mean turned by the same
rotation, R(n) mean, so the cache stores k_n - R(n) mean (`at`), and a query's score with that key misses
q . R(n) mean. With a rotation by cos/sin pairs (i, i + R/2) that product splits into a part of the query and a part
of the position:

    q . R(n) mean = query_terms(q) . table[n],   table[n] = (cos_n[:R/2], sin_n[:R/2], 1 where the head has
                                                                                        unrotated dimensions)

so a backend adds one small dot product per score (`MeanScores`): a torch matmul, or one more tl.dot per tile.
Every score comes back exactly; only the quantization of the (now smaller) rest differs. Measured on the bundled
model (bench/RESULTS.md): fp8 +0.68% perplexity -> +0.27%, int4 +6.3% -> +2.1%.
"""

from dataclasses import dataclass

import torch

from engine.layers.rotary_embedding import RotaryEmbedding


@dataclass
class MeanScores:
    """What centred keys took out of the scores: query_terms[t] . table[n] for query token t and key position n.
    Positions past the table's end read its last row (a layer without rotary has one row for every position)."""

    query_terms: torch.Tensor  # float32 [num_tokens, num_heads, width]
    table: torch.Tensor  # float32 [positions, width]

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The table's rows for key positions (any shape) -> [..., width]."""
        return self.table[positions.clamp(max=self.table.shape[0] - 1)]


class KeyMean:
    """One attention layer's mean key per KV head [num_kv_heads, head_dim] (zeros until calibrated), with the rotary
    tables its keys were turned by (None: a layer without positions, such as SmolLM3's NoPE layers)."""

    def __init__(self, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding | None, device: torch.device):
        self.mean = torch.zeros(num_kv_heads, head_dim, device=device)
        self.rotary_dim = 0 if rotary is None else rotary.rotary_dim
        half = self.rotary_dim // 2
        if rotary is None:
            self.cos = self.signed_sin = None
            self.table = torch.ones(1, 1, device=device)
        else:
            self.cos = rotary.cos_cache.float().to(device)
            self.signed_sin = rotary.signed_sin_cache.float().to(device)
            columns = [self.cos[:, :half], self.signed_sin[:, half:]]  # cos, and sin with its sign
            if self.rotary_dim < head_dim:  # the unrotated dimensions' share: the same at every position
                columns.append(torch.ones_like(self.cos[:, :1]))
            self.table = torch.cat(columns, dim=1)
        self._sums: torch.Tensor | None = None  # while calibrating: the keys before rotation, summed
        self._count = 0

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The mean key as the rotary embedding turned keys at `positions` [T]: float32 [T, num_kv_heads, head_dim]."""
        mean = self.mean.expand(len(positions), -1, -1)
        if self.cos is None:
            return mean
        r = self.rotary_dim
        cos, signed_sin = self.cos[positions, None], self.signed_sin[positions, None]
        turned = mean[..., :r] * cos + mean[..., :r].roll(r // 2, -1) * signed_sin
        return torch.cat((turned, mean[..., r:]), dim=-1)

    def scores(self, query: torch.Tensor) -> MeanScores:
        """query [T, num_heads, head_dim], as it meets the keys (rotary applied, not the cache's Hadamard rotation)."""
        q = query.float()
        mean = self.mean.repeat_interleave(q.shape[1] // self.mean.shape[0], dim=0)  # each query head's KV head's
        if self.cos is None:
            return MeanScores((q * mean).sum(-1, keepdim=True), self.table)
        r, half = self.rotary_dim, self.rotary_dim // 2
        q1, q2, m1, m2 = q[..., :half], q[..., half:r], mean[:, :half], mean[:, half:r]
        terms = [q1 * m1 + q2 * m2, q2 * m1 - q1 * m2]
        if r < q.shape[-1]:
            terms.append((q[..., r:] * mean[:, r:]).sum(-1, keepdim=True))
        return MeanScores(torch.cat(terms, dim=-1), self.table)

    # ---- calibration: the model's keys over a text, turned back to before the rotary embedding ----
    def start_calibration(self) -> None:
        self.mean.zero_()
        self._sums, self._count = torch.zeros_like(self.mean), 0

    def observe(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Keys [T, num_kv_heads, head_dim] as the rotary embedding left them at `positions`."""
        if self._sums is None:
            return
        k = keys.float()
        if self.cos is not None:
            r = self.rotary_dim
            cos, signed_sin = self.cos[positions, None], self.signed_sin[positions, None]
            # the inverse turn; cos^2 + sin^2 undoes a scaled rotation's factor (YaRN's, LongRoPE's) as well
            back = (k[..., :r] * cos - k[..., :r].roll(r // 2, -1) * signed_sin) / (cos * cos + signed_sin**2)
            k = torch.cat((back, k[..., r:]), dim=-1)
        self._sums += k.sum(0)
        self._count += len(k)

    def finish_calibration(self) -> None:
        if self._sums is not None and self._count:
            self.mean.copy_(self._sums / self._count)
        self._sums, self._count = None, 0
