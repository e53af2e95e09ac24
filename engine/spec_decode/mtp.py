"""MTP proposals: the multi-token-prediction head a model ships (Qwen3.5, Qwen3.6, Qwen3-Next; engine/models/
qwen3_5_mtp.py) drafts from the model's own hidden states, k tokens a step, and the model checks them in its next
step.

The head's row at position p reads the model's last hidden state at p and the embedding of token p + 1, and
predicts token p + 2. It runs as a draft model does (draft_model.py: a ModelRunner over the head, a KV cache and a
prefix cache of its own, a mirror Sequence per request), with two differences:
- a mirror's tokens are the request's shifted by one, so that its row at position p reads token p + 1;
- each row also takes a hidden state: the model's for the positions the model has computed (the model's runner
  keeps each step's, and they wait here, per request, until the head has read them), the head's own output for
  the rows of its drafts. A draft's row thus differs from what the model's hidden state would give: every step
  computes those rows again, the accepted ones now from the model's hidden states.

A request whose hidden states the model never computed (the model's prefix cache held a part of its prompt that
the head's cache no longer holds) gets no MTP drafts while it runs; its reply is the same, only not faster.
"""

from dataclasses import dataclass, replace

import torch

from engine import quantization
from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.loader import GGUFCheckpoint, resolve_gguf, resolve_model_path
from engine.models.qwen3_5 import Qwen3_5ForCausalLM
from engine.models.qwen3_5_mtp import load_mtp_head, mtp_layer_count
from engine.runner.model_runner import ModelRunner
from engine.spec_decode.draft_model import DraftModelProposer, Mirror
from engine.spec_decode.speculator import speculates

HEAD_BLOCKS_PER_MODEL_BLOCK = 2  # one layer's KV is small: a larger prefix cache, which keeps more requests' drafts


@dataclass
class MtpMirror(Mirror):
    exact: int = 0  # leading positions computed from the model's hidden states, not the head's own
    out: torch.Tensor | None = None  # the head's output at its last computed row: its next draft's hidden input


class HiddenStash:
    """A request's hidden states from the model's steps, by position, until the head has read them."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, torch.Tensor]] = []  # (first position, rows), in order

    def put(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions `start` on; the rows kept for those positions are stale (rejected drafts' rows, now
        computed again)."""
        self.pieces = [(s, t[: start - s]) for s, t in self.pieces if s < start] + [(start, rows)]

    def holds(self, start: int, n: int) -> bool:
        return self._parts(start, n) is not None

    def take(self, start: int, n: int) -> torch.Tensor | None:
        """The rows of positions start .. start + n - 1, or None if some are missing."""
        parts = self._parts(start, n)
        return None if parts is None else torch.cat(parts)

    def _parts(self, start: int, n: int) -> list[torch.Tensor] | None:
        parts, position = [], start
        for s, rows in self.pieces:
            if s <= position < s + len(rows):
                part = rows[position - s : start + n - s]
                parts.append(part)
                position += len(part)
        return parts if position == start + n else None

    def drop_before(self, position: int) -> None:
        self.pieces = [(max(s, position), t[max(0, position - s) :]) for s, t in self.pieces if s + len(t) > position]


class MtpProposer(DraftModelProposer):
    mirror_type = MtpMirror

    def __init__(self, runner, block_manager, max_num_batched_tokens: int, target_runner):
        """`runner`: a ModelRunner over the head; `target_runner`: the model's, made to keep its hidden states."""
        super().__init__(runner, block_manager, max_num_batched_tokens, target_runner.vocab_size)
        self.target_runner = target_runner
        runner.keep_hidden = target_runner.keep_hidden = True
        self.stashes: dict[int, HiddenStash] = {}  # by the target sequence's seq_id
        self.blind: set[int] = set()  # running requests whose hidden states the model never computed
        self.running: list[Sequence] = []  # those that may draft

    def retain(self, seqs: list[Sequence]) -> None:
        """Take the model's last step's hidden states; drop what is kept for requests no longer running."""
        live = {seq.seq_id for seq in seqs}
        # the rows of a request that never drafts would wait here for ever
        drafting = {seq.seq_id for seq in seqs if speculates(seq) and seq.seq_id not in self.blind}
        self.running = [seq for seq in seqs if seq.seq_id in drafting]
        step, self.target_runner.last_hidden = self.target_runner.last_hidden, None
        if step is not None:
            for i, seq_id in enumerate(step.seq_ids):
                if seq_id in drafting:  # a copy: the step's whole tensor is not held for a few rows
                    rows = step.hidden[step.rows[i] : step.rows[i + 1]].clone()
                    self.stashes.setdefault(seq_id, HiddenStash()).put(step.starts[i], rows)
        super().retain(seqs)
        self.stashes = {seq_id: stash for seq_id, stash in self.stashes.items() if seq_id in live}
        self.blind &= live

    def release(self) -> None:
        self.stashes.clear()
        self.target_runner.keep_hidden, self.target_runner.last_hidden = False, None
        super().release()

    def _followers(self, requests: list[tuple[Sequence, int]]) -> list[MtpMirror]:
        """Every other request that may draft: the head reads each step's new tokens of all of them, so that its
        prefix cache keeps up with the model's (a request whose prompt the model's cache held and the head's did not
        could never draft) and hidden states wait here one step at most."""
        asked = {seq.seq_id for seq, _ in requests}
        synced = (self._synced(seq) for seq in self.running if seq.seq_id not in asked and seq.seq_id in self.stashes)
        return [mirror for mirror in synced if mirror is not None]

    def _tokens(self, target: Sequence) -> list[int]:
        """Shifted by one, up to the token after the model's last computed one: row p reads token p + 1 and the
        model's hidden state at p (a request still reading its prompt has those of its computed part only)."""
        return target.token_ids[1 : target.num_computed_tokens + 1]

    def _reusable(self, mirror: MtpMirror) -> int:
        return mirror.exact

    def _synced(self, target: Sequence) -> MtpMirror | None:
        """As a draft model's, and None for a request whose hidden states the head needs and the model never
        computed."""
        if target.seq_id in self.blind:
            return None
        mirror = super()._synced(target)
        if mirror is None:
            return None
        seq, stash = mirror.seq, self.stashes.get(target.seq_id)
        missing = len(seq) - seq.num_computed_tokens
        if missing and (stash is None or not stash.holds(seq.num_computed_tokens, missing)):
            self.blind.add(target.seq_id)
            self.stashes.pop(target.seq_id, None)
            self._drop(mirror)
            return None
        return mirror

    def _run(self, batch):
        """As a draft model's step, with each row's hidden input: the model's for its tokens' positions, the
        head's own output for a draft's."""
        if not batch:
            return iter(())
        inputs = []
        for mirror, item in batch:
            start, n = item.seq.num_computed_tokens, item.num_new_tokens
            if start < mirror.synced:
                rows = self.stashes[mirror.target_id].take(start, n)
                if rows is None:  # _synced checked them: a bug, which stops speculation (Speculator.propose)
                    raise RuntimeError(f"the model's hidden states for positions {start}..{start + n - 1} are gone")
                inputs.append(rows)
            else:
                inputs.append(mirror.out[None])
        head = self.runner.model
        head.hidden_in = torch.cat(inputs)
        try:
            tokens = super()._run(batch)
        finally:
            head.hidden_in = None
        step, self.runner.last_hidden = self.runner.last_hidden, None
        block = self.block_manager.block_size
        for (mirror, item), end in zip(batch, step.rows[1:], strict=True):
            mirror.out = step.hidden[end - 1].clone()
            computed = item.seq.num_computed_tokens
            if computed <= mirror.synced:  # rows of the model's tokens
                mirror.exact = computed
                # what a mirror made again would read: from its last partial block on (its full ones are cached)
                self.stashes[mirror.target_id].drop_before(computed - computed % block)
        return tokens


def load_mtp_proposer(target) -> MtpProposer:
    """The MTP head of `target` (an LLMEngine whose runner is loaded) loaded from its checkpoint beside it, on a
    ModelRunner of its own. A model without a head Pagoda can run gets a ValueError that says what to use."""
    runner, name = target.model_runner, target.config.model
    if target.pooling is not None:
        raise ValueError("speculative decoding is for generating text; an embedding model has nothing to draft")
    if not isinstance(runner.model, Qwen3_5ForCausalLM):
        raise ValueError(
            f'speculative_config method "mtp" needs a model that ships a multi-token-prediction head (Qwen3.5, '
            f"Qwen3.6, Qwen3-Next); {name} ({type(runner.model).__name__}) has none. Use "
            '{"method": "ngram"} or a draft model ({"method": "draft", "model": ...}) instead'
        )
    config = getattr(runner.hf_config, "text_config", runner.hf_config)
    if mtp_layer_count(config) != 1:
        raise ValueError(
            f"{name}'s multi-token-prediction head has {mtp_layer_count(config)} layers; Pagoda drafts with "
            'one-layer heads (Qwen3.5, Qwen3.6, Qwen3-Next) only. Use {"method": "ngram"} or a draft model'
        )
    if runner.from_gguf:  # its blocks after the model's, quantized as the model's are
        target_kernels = quantization.KernelTarget(runner.device, runner.dtype, onednn=runner.packed_weights)
        head = load_mtp_head(runner.model, runner.hf_config, GGUFCheckpoint.open(resolve_gguf(name)), target_kernels)
    else:
        head = load_mtp_head(runner.model, runner.hf_config, resolve_model_path(name))
    head_config = replace(
        target.config,
        speculative_config=None,
        num_kvcache_blocks=HEAD_BLOCKS_PER_MODEL_BLOCK * runner.num_blocks,
        kv_cache_memory_bytes=None,
        kv_cache_dtype="auto",  # a format that centres keys would measure them with the tokenizer: not worth it
        max_model_len=runner.max_model_len,
        enforce_eager=True,  # its steps take hidden states beside the tokens
        async_scheduling=False,
    )
    head_runner = ModelRunner(head_config, config, None, target.device, target.dtype, model=head)
    block_manager = BlockManager(
        head_runner.num_blocks, head_config.kvcache_block_size, head_config.enable_prefix_caching
    )
    return MtpProposer(head_runner, block_manager, target.scheduler.max_num_batched_tokens, runner)
