"""Measuring each attention layer's mean key at load, for the KV-cache formats that centre keys
(engine/attention/key_mean.py).

The model reads a built-in text of 512 tokens, as eight prompts of 64 (so that any max_model_len and any cache size
give the same means), through a small unquantized cache of its own, and every layer averages its keys. It takes a
second or two on a laptop's CPU, and on a GPU a few MB beside the KV cache. Random tokens would not do: their keys
share less of the common vector than a text's (on the bundled model, int4 KV +5.9% perplexity calibrated on random
tokens, +1.9% on 512 tokens of text, +2.9% on 64). The text is fixed, so a model gets the same means at every load.
"""

from concurrent.futures import Future

import torch
from torch import nn

from engine.attention.kv_format import PLAIN
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence
from engine.front.sampling_params import SamplingParams
from engine.layers.attention import Attention
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.runner.step_inputs import prepare_step

CALIBRATION_TOKENS = 512  # read as windows of CALIBRATION_WINDOW tokens, one at a time
CALIBRATION_WINDOW = 64  # short enough for any max_model_len a test sets; best of 64, 128 and 512 here (RESULTS.md)

# Plain prose, dialogue, a list and a little code: what a chat model reads. Written for this purpose.
CALIBRATION_TEXT = """The lighthouse keeper kept a notebook on the table by the window, and every evening she wrote down
the weather, the ships she had seen, and anything else that seemed worth remembering. Most entries were short. "Wind
from the west, light rain, two fishing boats came in before dark." Some were longer, when a storm had kept her awake or
when a letter had come from her brother in the city, who wrote about trams, crowded markets and a job he did not like.

User: Can you explain how a hash table works, in simple terms?
Assistant: Sure. A hash table stores values under keys. When you add an item, a hash function turns its key into a
number, and that number picks one of many buckets. To look the item up later, the table hashes the key again and goes
straight to the same bucket, so it does not have to search through everything. Two keys can land in the same bucket;
then the table keeps a short list there, or probes the next free slot. As long as the buckets stay lightly filled,
adding and finding items takes about the same time no matter how many there are.

User: Thanks! And what should I pack for a three-day hike in the mountains?
Assistant: Here is a short checklist:
1. Layers: a warm fleece, a waterproof jacket and a hat, because mountain weather changes quickly.
2. Water and a way to filter more, plus food that is light and easy to eat: nuts, dried fruit, oats.
3. A map, a compass and a charged phone, and tell someone your route and when you expect to return.
4. A small first-aid kit, sun cream, a head torch and spare batteries.

def moving_average(values, window):
    \"\"\"Return the average of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    totals, result = 0.0, []
    for i, value in enumerate(values):
        totals += value
        if i >= window:
            totals -= values[i - window]
        if i >= window - 1:
            result.append(totals / window)
    return result

In the spring of that year the village council met to decide what to do about the old bridge. Some people wanted to
repair it, because their grandparents had built it and it still carried carts to the mill. Others said a new bridge
would be cheaper in the long run and safer for the school bus. The meeting went on for three hours. In the end they
agreed to ask an engineer, to publish her report in the newspaper, and to vote again in the autumn. Prices rose by
about four percent over the year, the harvest was good, and the new library opened on the first Saturday of June, with
music in the square and a table of free books for anyone who wanted one.
"""


def layer_rotaries(model: nn.Module) -> dict[int, RotaryEmbedding | None]:
    """Each Attention's rotary embedding, by id: every model's attention block holds its Attention as `attn` beside
    the `rotary` that turns its keys (None for a layer without positions)."""
    holders = [m for m in model.modules() if isinstance(getattr(m, "attn", None), Attention)]
    return {id(m.attn): getattr(m, "rotary", None) for m in holders}


@torch.inference_mode()
def calibrate_key_means(runner, tokenizer: Future | None, max_position: int) -> None:
    """Measure the mean key of every layer of `runner` (a ModelRunner, before any request) whose format centres
    keys. `tokenizer`: a future of the model's tokenizer, which encodes the text."""
    layers = [layer for layer in runner.attention_layers if layer.key_mean is not None]
    if not layers:
        return
    if tokenizer is None:
        raise ValueError(f"kv_cache_dtype={layers[0].kv_format.name!r} measures a mean key at load, with the tokenizer")
    token_ids = tokenizer.result().encode(CALIBRATION_TEXT)
    window = min(CALIBRATION_WINDOW, max_position)
    num_blocks, bs = -(-window // runner.block_size), runner.block_size
    kept = [(layer.k_cache, layer.v_cache, layer.kv_format, layer.kv_rotation) for layer in layers]
    for layer in layers:  # a small cache of the model's dtype of its own: the model as trained, any cache size
        shape = (num_blocks, bs, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = (torch.zeros(shape, dtype=runner.dtype, device=runner.device) for _ in "kv")
        layer.kv_format, layer.kv_rotation = PLAIN, None
        layer.key_mean.start_calibration()
    try:
        for start in range(0, min(len(token_ids), CALIBRATION_TOKENS) - window + 1, window):
            seq = Sequence(token_ids[start : start + window], SamplingParams(max_tokens=1))
            seq.block_tables = [list(range(num_blocks)) for _ in runner.kv_groups.windows]
            if runner.state_slots[0]:  # a hybrid model's recurrent layers: the scratch slot, which no request holds
                seq.state_slot = -1
            input_ids, positions, meta, _, _ = runner.to_device(prepare_step([ScheduledSeq(seq, window)], bs, {}))
            runner.model(input_ids, positions, meta)
    finally:
        for layer, (k_cache, v_cache, kv_format, rotation) in zip(layers, kept, strict=True):
            layer.k_cache, layer.v_cache, layer.kv_format, layer.kv_rotation = k_cache, v_cache, kv_format, rotation
            layer.key_mean.finish_calibration()
