"""Incremental detokenisation that never emits half of a multi-byte character.

Each step decodes a short window of recent tokens twice, with and without the newest ones, and
emits the difference. Decoding a window rather than single tokens keeps the spaces right for
tokenizers whose pieces depend on their neighbours; holding back text that ends in U+FFFD
keeps a character split across tokens (CJK, emoji) from coming out broken.
"""
from engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, seq: Sequence, final: bool = False) -> str:
        """Append the text of `seq`'s newest output tokens to `seq.output_text`; return the addition."""
        ids = seq.output_token_ids
        prefix_text = self.decode(ids[seq.prefix_offset : seq.read_offset])
        full_text = self.decode(ids[seq.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""
        new_text = full_text[len(prefix_text) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += new_text
        return new_text
