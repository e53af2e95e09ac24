"""Incremental detokenisation that never emits half of a multi-byte character.

Each step decodes a short window of recent tokens twice, with and without the newest ones, and
emits the difference. Decoding a window rather than single tokens keeps the spaces right for
tokenizers whose pieces depend on their neighbours; holding back text that ends in U+FFFD
keeps a character split across tokens (CJK, emoji) from coming out broken. The window stays
short, so a step costs the same at token 10 and at token 10,000.
"""

from engine.core.sequence import Sequence

# A UTF-8 character spans at most 4 bytes, so a longer undecodable run is genuinely invalid text.
MAX_HELD_TOKENS = 8
INCOMPLETE_CHARACTER_BYTES = 3


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # transformers' decode wraps the Rust tokenizer in ~20 us of Python per call; with hundreds
        # of running requests that is milliseconds per step. Call the Rust one directly where it
        # gives the same text (no extra clean-up pass).
        fast = getattr(tokenizer, "_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._fast_decode = fast.decode if fast is not None and not cleans_up else None

    def decode(self, token_ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, seq: Sequence, final: bool = False) -> str:
        """Append the text of `seq`'s newest output tokens to `seq.output_text`; return the addition."""
        start = seq.num_prompt_tokens
        prefix_text = self.decode(seq.token_ids[start + seq.prefix_offset : start + seq.read_offset])
        full_text = self.decode(seq.token_ids[start + seq.prefix_offset :])
        num_output = len(seq.token_ids) - start
        held = num_output - seq.read_offset
        upto = num_output
        if full_text.endswith("\ufffd") and not final:
            if held < MAX_HELD_TOKENS:
                return ""  # wait for the rest of the character
            # Invalid text: let out all but the last tokens, which may still start a character (an
            # incomplete one has at most 3 bytes); emitting those too would fix their U+FFFD for good.
            upto = num_output - INCOMPLETE_CHARACTER_BYTES
            full_text = self.decode(seq.token_ids[start + seq.prefix_offset : start + upto])
        new_text = full_text[len(prefix_text) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, upto
        seq.output_text += new_text
        return new_text
