"""Centred keys, for the KV-cache formats that lose the most on keys (fp8, int4; `KVFormat.centres_keys`).

The keys of a head share a large common vector: 60-70% of their energy on the bundled model. A per-token scale sized
for it leaves the part that differs between tokens only a few quantization levels, and that part is what tells one
key from another. So the cache stores each key less the head's mean key, and attention adds back exactly what that
took out of every score.

The mean is measured before the rotary embedding, where it is one vector at every position (on a text run through
the model at load: engine/runner/key_means.py). After the embedding, the key at position n carries the mean turned
by the same rotation, R(n) mean, so the cache stores k_n - R(n) mean (`at`), and a query's score with that key
misses q . R(n) mean. With a rotation by cos/sin pairs (i, i + R/2) that product splits into a part of the query
and a part of the position:

    q . R(n) mean = query_terms(q) . table[n],   table[n] = (cos_n[:R/2], sin_n[:R/2], 1 where the head has
                                                                                        unrotated dimensions)

so a backend adds one small dot product per score (`MeanScores`): a torch matmul, or one more tl.dot per tile; or,
where many queries read the same keys (a prefill), it adds the turned mean back to the keys instead.
Every score comes back exactly; only the quantization of the (now smaller) rest differs. Measured on the bundled
model (bench/RESULTS.md): fp8 +0.68% perplexity -> +0.27%, int4 +6.3% -> +2.1%.
"""

import weakref
from dataclasses import dataclass

import torch

from engine.layers.rotary_embedding import RotaryEmbedding

_TABLES: "weakref.WeakKeyDictionary[RotaryEmbedding, torch.Tensor]" = weakref.WeakKeyDictionary()


def table_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table[positions.clamp(max=table.shape[0] - 1)]


@dataclass
class MeanScores:
    """What centred keys took out of the scores: query_terms[t] . table[n] for query token t and key position n.
    Positions past the table's end read its last row (a layer without rotary has one row for every position).
    A backend adds that to the scores (cheap for a few queries: decode), or the mean back to the keys it read
    (`mean_keys`: cheap for many: a prefill)."""

    query_terms: torch.Tensor  # float32 [num_tokens, num_heads, width]
    table: torch.Tensor  # float32 [positions, width]
    key_mean: "KeyMean | None" = None

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The table's rows for key positions (any shape) -> [..., width]."""
        return table_rows(self.table, positions)

    def first_rows(self, length: int) -> torch.Tensor:
        """The rows of positions 0..length-1 [length, width]: a view where the table is that long."""
        table = self.table
        if length > len(table):
            table = torch.cat((table, table[-1:].expand(length - len(table), -1)))
        return table[:length]

    def mean_keys(self, positions: torch.Tensor) -> torch.Tensor:
        """What to add to the keys read back at `positions` [L] (as the cache stores them, rotated by its Hadamard
        matrix) to have the keys again: float32 [L, num_kv_heads, head_dim]."""
        return torch.einsum("lw,kwd->lkd", self.rows(positions), self.key_mean.stored_map)


class KeyMean:
    """One attention layer's mean key per KV head (zeros until calibrated), with the rotary tables its keys were
    turned by (None: a layer without positions, such as SmolLM3's NoPE layers), and `rotation`, the Hadamard matrix
    its cache stores keys under.

    The mean turned to position n is linear in the table's row n: at(n) = table[n] @ map (`map` [kv heads, width,
    head_dim], made from the mean), and so is a query's share, query @ map^T. Both are one small matmul a layer."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None,
        device: torch.device,
        rotation: torch.Tensor | None = None,
    ):
        self.rotary_dim, self.rotation = 0 if rotary is None else rotary.rotary_dim, rotation
        half = self.rotary_dim // 2
        if rotary is None:
            self.cos = self.signed_sin = None
            self.table = torch.ones(1, 1, device=device)
        else:
            self.cos = rotary.cos_cache.float().to(device)
            self.signed_sin = rotary.signed_sin_cache.float().to(device)
            # One table for every layer its rotary turns: [max_position, width] floats, MBs at a long context
            self.table = _TABLES.get(rotary)
            if self.table is None:
                columns = [self.cos[:, :half], self.signed_sin[:, half:]]  # cos, and sin with its sign
                if self.rotary_dim < head_dim:  # the unrotated dimensions' share: the same at every position
                    columns.append(torch.ones_like(self.cos[:, :1]))
                self.table = _TABLES[rotary] = torch.cat(columns, dim=1)
        self.set_mean(torch.zeros(num_kv_heads, head_dim, device=device))
        self._sums: torch.Tensor | None = None  # while calibrating: the keys before rotation, summed
        self._count = 0

    def set_mean(self, mean: torch.Tensor) -> None:
        """[num_kv_heads, head_dim] float32; builds the maps the steps use."""
        self.mean = mean.float()
        r, half = self.rotary_dim, self.rotary_dim // 2
        if r == 0:
            self.map = self.mean[:, None, :].clone()
        else:
            m1, m2 = self.mean[:, :half], self.mean[:, half:r]
            self.map = torch.zeros(len(mean), self.table.shape[1], mean.shape[1], device=mean.device)
            index = torch.arange(half, device=mean.device)
            # at(n)[i] = m1 cos - m2 sin, at(n)[half + i] = m2 cos + m1 sin; the unrotated rest: the mean itself
            self.map[:, index, index], self.map[:, half + index, index] = m1, -m2
            self.map[:, index, half + index], self.map[:, half + index, half + index] = m2, m1
            if r < mean.shape[1]:
                self.map[:, -1, r:] = self.mean[:, r:]
        self.stored_map = self.map if self.rotation is None else self.map @ self.rotation

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The mean key as the rotary embedding turned keys at `positions` [T]: float32 [T, num_kv_heads, head_dim]."""
        return torch.einsum("tw,kwd->tkd", table_rows(self.table, positions), self.map)

    def scores(self, query: torch.Tensor) -> MeanScores:
        """query [T, num_heads, head_dim], as it meets the keys (rotary applied, not the cache's rotation)."""
        q = query.float().unflatten(1, (self.map.shape[0], -1))  # [T, kv heads, its query heads, head_dim]
        terms = torch.einsum("tkgd,kwd->tkgw", q, self.map).flatten(1, 2)
        return MeanScores(terms, self.table, self)

    # ---- calibration: the model's keys over a text, turned back to before the rotary embedding ----
    def start_calibration(self) -> None:
        self.set_mean(torch.zeros_like(self.mean))
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
            self.set_mean(self._sums / self._count)
        self._sums, self._count = None, 0
