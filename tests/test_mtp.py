"""Speculative decoding with the multi-token-prediction head a Qwen3.5 checkpoint ships (engine/spec_decode/mtp.py):
the head drafts from the model's hidden states, and the model checks its drafts.

What must hold: the head's drafts are those of a reference built from transformers' own layers and the head's
tensors (the model's hidden state at p and token p + 1's embedding predict token p + 2; each later draft reads the
head's own output), at the first step and after steps that checked drafts; a head that predicts what the model
does gets every draft accepted; greedy output is the plain run's, token for token, in batches, over prefix-cache
hits, chunked prefill and preemption; a model without a head is refused at load with what to use instead.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.conftest import build_tokenizer, qwen3_5_model, widen_weights
from tests.test_gguf_engine import prompt_ids
from tests.test_gguf_families import exact_kernels, tokenizer_folder  # noqa: F401 (fixtures)
from tests.test_qwen3_5_mtp import checkpoint_with_mtp, random_head

K = 3


def mtp(k: int = K) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "min_acceptance_rate": 0}


def greedy(max_tokens=30):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 30, 13, 52)]


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def mtp_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp-moe" if request.param else "mtp-dense")
    checkpoint_with_mtp(folder, moe=request.param)
    return folder


@torch.no_grad()
def reference_drafts(folder, hf, tokens: list[int], k: int) -> list[int]:
    """k drafts after `tokens` (the last not yet read by the model), from transformers' layers: rows p of the
    model's tokens read its hidden state at p and token p + 1; a draft's row the head's own output before it."""
    config = hf.config
    text = getattr(config, "text_config", config)
    module = __import__(type(hf).__module__, fromlist=["x"])
    layer_class = next(getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer"))
    norm_class = next(getattr(module, n) for n in dir(module) if n.endswith("RMSNorm"))
    full = text.layer_types.index("full_attention")
    tensors = {n.removeprefix("mtp."): t for n, t in load_file(str(folder / "mtp.safetensors")).items()}
    layer = layer_class(text, full).eval()
    layer.load_state_dict({n.removeprefix("layers.0."): t for n, t in tensors.items() if n.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = norm_class(text.hidden_size, eps=text.rms_norm_eps)
        norms[name].weight.copy_(tensors[f"{name}.weight"])
    fc = tensors["fc.weight"]

    ids = torch.tensor([tokens])
    model_hidden = hf.model(input_ids=ids[:, :-1]).last_hidden_state[0]  # positions 0 .. L - 2
    inputs, hidden_in, drafts = tokens[1:], list(model_hidden), []
    for _ in range(k):
        n = len(inputs)
        x = (
            torch.cat(
                (
                    norms["pre_fc_norm_embedding"](hf.model.embed_tokens(torch.tensor(inputs))),
                    norms["pre_fc_norm_hidden"](torch.stack(hidden_in)),
                ),
                dim=-1,
            )
            @ fc.T
        )
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(
            x[None],
            position_embeddings=hf.model.rotary_emb(x[None], positions),
            attention_mask=mask,
            position_ids=positions,
        )
        out = norms["norm"](out[0] if isinstance(out, tuple) else out)[0]
        drafts.append(int(hf.lm_head(out[-1]).argmax()))
        inputs, hidden_in = inputs + [drafts[-1]], hidden_in + [out[-1]]
    return drafts


def test_the_heads_drafts_are_a_reference_built_from_transformers_layers(make_llm, mtp_model, hf_model, prompts):
    llm = make_llm(mtp_model, speculative_config=mtp())
    hf = hf_model(mtp_model)
    request_id = llm.add_request(prompts[1], greedy(40))
    seq = llm.requests[request_id]
    checked = 0
    for _ in range(6):  # the first step reads the prompt; each later one checks the drafts before it
        llm.step()
        if seq.draft_token_ids:
            assert seq.draft_token_ids == reference_drafts(mtp_model, hf, seq.token_ids, len(seq.draft_token_ids))
            checked += 1
    assert checked >= 3


def test_greedy_output_is_the_plain_runs_in_batches_over_hits_chunks_and_preemption(make_llm, mtp_model, prompts):
    """Beside the drafting requests, one with a repetition penalty decodes plainly: the head keeps nothing of it."""
    params = [greedy(40), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3)]
    params += [greedy(40)] * 2
    plain = make_llm(mtp_model).generate(prompts, params, use_tqdm=False)
    # 12 blocks of 16 for four requests of up to 92 tokens: some are preempted; 32-token chunks; the recurrent
    # state kept every 16 tokens, so that prompts hit the prefix cache
    settings = dict(num_kvcache_blocks=12, max_num_batched_tokens=32, state_snapshot_tokens=16)
    llm = make_llm(mtp_model, speculative_config=mtp(), **settings)
    first = llm.generate(prompts, params, use_tqdm=False)
    proposer = llm.speculator.proposer
    request_ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    again = {}
    while llm.has_unfinished_requests():  # both caches serve the prompts
        again |= {out.request_id: out.token_ids for out in llm.step() if out.finished}
        penalized = llm.requests.get(request_ids[1])
        assert penalized is None or penalized.seq_id not in proposer.stashes
    stats = llm.stats()
    assert stats.speculative_method == "mtp"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_steps > 0
    assert [f["token_ids"] for f in first] == [p["token_ids"] for p in plain]
    assert [again[r] for r in request_ids] == [p["token_ids"] for p in plain]
    assert first[1]["speculation"] is None
    assert not proposer.mirrors and not proposer.stashes and proposer.target_runner.keep_hidden
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks


def bigram_checkpoint(folder) -> None:
    """A model whose layers add nothing (its next token depends on its last token only) and a head that predicts
    what the model does: the head's fc passes the embedding through, and its layer adds nothing either."""
    torch.manual_seed(3)
    model = qwen3_5_model(False)
    widen_weights(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "norm.weight")):
                p.zero_()  # the layers' outputs, and the final norm's offset from a scale of 1
    model.save_pretrained(folder)
    build_tokenizer(folder)
    last, size = f"model.layers.{model.config.num_hidden_layers - 1}.", model.config.hidden_size
    head = {
        f"mtp.layers.0.{n.removeprefix(last)}": t.clone() for n, t in model.state_dict().items() if n.startswith(last)
    }
    head |= {f"mtp.{n}.weight": torch.zeros(size) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    head["mtp.fc.weight"] = torch.cat((torch.eye(size), torch.zeros(size, size)), dim=1)
    save_file({n: t.contiguous() for n, t in head.items()}, str(folder / "mtp.safetensors"))


@pytest.fixture(scope="module")
def bigram_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp-bigram")
    bigram_checkpoint(folder)
    return folder


def test_a_head_that_predicts_as_the_model_does_gets_every_draft_accepted(make_llm, bigram_model, prompts):
    """Every token but a reply's first (and its last, where no draft fits) comes from a step that checked drafts: a
    request that lost its hidden states would decode plainly."""
    plain = make_llm(bigram_model).generate(prompts, greedy(), use_tqdm=False)
    llm = make_llm(bigram_model, speculative_config=mtp())
    out = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [p["token_ids"] for p in plain]
    stats = llm.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert (stats.spec_accepted_tokens + stats.spec_steps) / stats.spec_steps >= 0.9 * (K + 1)
    for o in out:
        steps, _, accepted = o["speculation"]
        assert steps + accepted >= len(o["token_ids"]) - 2


def test_a_prompt_the_model_finds_cached_while_another_reads_it_still_drafts(make_llm, bigram_model):
    """The second request arrives while the first still reads the same long prompt, in chunks: the model's prefix
    cache serves it blocks the first one filled, and the head's cache must hold them too (it reads every step's new
    tokens, not only those of requests that draft)."""
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 200, (100,), generator=g).tolist()
    settings = dict(max_num_batched_tokens=16, state_snapshot_tokens=16)
    plain = make_llm(bigram_model, **settings).generate([prompt], greedy(), use_tqdm=False)[0]
    llm = make_llm(bigram_model, speculative_config=mtp(), **settings)
    proposer = llm.speculator.proposer
    first = llm.add_request(prompt, greedy())
    for _ in range(4):  # 64 of its 100 prompt tokens
        llm.step()
    second = llm.add_request(prompt, greedy())
    finished = {}
    while llm.has_unfinished_requests():
        finished |= {o.request_id: o for o in llm.step() if o.finished}
        assert not proposer.blind
        # rows wait one step at most, and those of the last partial block a bit longer: 16 + 16 rows at most
        assert all(sum(len(rows) for _, rows in stash.pieces) <= 32 for stash in proposer.stashes.values())
    assert llm.stats().prefix_cache_hits > 0
    for request_id in (first, second):
        assert finished[request_id].token_ids == plain["token_ids"]
        steps, _, accepted = finished[request_id].speculation
        assert steps + accepted >= len(plain["token_ids"]) - 2


def test_a_model_without_a_head_is_refused_with_what_to_use(make_llm, tiny_llama, tmp_path):
    with pytest.raises(ValueError, match='method "mtp" needs a model that ships a multi-token-prediction head'):
        make_llm(tiny_llama, speculative_config=mtp())
    torch.manual_seed(7)
    qwen3_5_model(False).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    with pytest.raises(ValueError, match='has no multi-token-prediction head .*"ngram"'):
        make_llm(tmp_path, speculative_config=mtp())


def test_a_gguf_files_head_drafts_as_the_reference_does(tmp_path, tokenizer_folder, exact_kernels):  # noqa: F811
    """A Qwen3.5 GGUF file that keeps the head (as convert_hf_to_gguf does: the block after the model's, its fc and
    matrices in Q8_0, its norms as 1 + weight) drafts what the reference drafts with the file's weights."""
    import gguf

    from tests.test_gguf_qwen3_5 import mtp_gguf_name, tiny_qwen3_5, with_file_weights, write_qwen3_5_gguf

    model = tiny_qwen3_5(False)
    head = random_head(model)
    path = write_qwen3_5_gguf(tmp_path / "qwen35.gguf", model, tokenizer_folder, mtp=True, head=head)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    as_stored = {}  # the head's tensors as the file holds them, dequantized, the norms' 1 taken off again
    for name, value in head.items():
        t = stored[mtp_gguf_name(name, model.config)]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w - 1 if t.name.endswith("norm.weight") else w  # every norm of the block, the nextn ones too
        as_stored[f"mtp.{name}"] = w.reshape(value.shape).contiguous()
    save_file(as_stored, str(tmp_path / "mtp.safetensors"))
    reference = with_file_weights(tiny_qwen3_5(False), path)

    llm = LLM(str(path), dtype="float32", num_kvcache_blocks=64, speculative_config=mtp())
    request_id = llm.add_request(prompt_ids(4, 30), greedy(40))
    seq, checked = llm.requests[request_id], 0
    for _ in range(6):
        llm.step()
        if seq.draft_token_ids:
            assert seq.draft_token_ids == reference_drafts(tmp_path, reference, seq.token_ids, len(seq.draft_token_ids))
            checked += 1
    assert checked >= 3
