"""Runs the model for one scheduled batch: uploads its inputs, owns the KV cache, samples.

With tensor parallelism, every rank has a ModelRunner over its shard of the weights and KV cache. Rank 0 builds each
step's inputs and sends them to the workers (engine/runner/tp_workers.py), which `execute` the same step; only rank 0
gets logits and samples.

The host arrays of a step come from engine/runner/step_inputs.py, the KV cache's size and layout from
engine/runner/kv_cache.py; this file keeps what touches the device.
"""

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine import quantization
from engine.attention import AttentionBackend, AttentionMetadata, select_backend
from engine.attention.kv_format import kv_format
from engine.config import EngineConfig, batched_token_budget
from engine.core.scheduler import ScheduledSeq
from engine.layers.attention import Attention
from engine.layers.linear import can_pack_for_cpu, pack_for_cpu
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.loader import GGUFCheckpoint, load_tensors, load_weights, without_head
from engine.models import model_class
from engine.runner.background import EngineActivity
from engine.runner.compiled_decode import CompiledDecode, compile_disabled_by_env, with_groups, yield_to_the_engine
from engine.runner.cuda_graph import DecodeGraphs
from engine.runner.distributed import SINGLE, TPGroup
from engine.runner.kernel_passes import choose_gemv, choose_normed, compiled_small_ops
from engine.runner.key_means import calibrate_key_means, layer_rotaries
from engine.runner.kv_cache import (
    allocate_kv_cache,
    allocate_states,
    choose_num_blocks,
    fitting_max_model_len,
    gpu_kv_budget,
    plan_kv_cache,
)
from engine.runner.memory import check_weights_fit, give_back_freed_memory, held_weight_bytes
from engine.runner.staging import StagingBuffer
from engine.runner.step_inputs import (
    HiddenStates,
    LogprobsPlan,
    SampledRows,
    StepInputs,
    logprobs_plan,
    prepare_step,
)
from engine.runner.tracing import MODULE_CALLS
from engine.sample.logprobs import LogprobsTensors, gather_logprobs, prompt_logprobs
from engine.sample.rejection import verify_drafts
from engine.sample.sampler import Sampler

__all__ = ["LaunchedStep", "ModelRunner", "StepInputs"]  # StepInputs: its old home, for importers

log = logging.getLogger("engine")


@dataclass
class LaunchedStep:
    """A step enqueued on the device, and where its sampled tokens arrive on the host."""

    batch: list[ScheduledSeq]
    tokens: torch.Tensor | None  # one per batch item that samples, in order; None if none samples
    ready: torch.cuda.Event | None  # recorded once `tokens` holds the values; None: they are there now
    # Only where some request asked for logprobs (on the host, valid once `ready`):
    logprobs_plan: LogprobsPlan | None = None
    sample_logprobs: LogprobsTensors | None = None  # rows: plan.sample_rows
    prompt_logprobs: LogprobsTensors | None = None  # rows: plan.prompt_rows


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        model_path,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPGroup = SINGLE,
        workers=None,
        tokenizer: Future | None = None,
        model: nn.Module | None = None,
    ):
        """`tp`: this rank's place in a tensor-parallel group; `workers`: rank 0's WorkerPool, if any; `tokenizer`:
        a future of the model's, which a KV-cache format that centres keys needs (engine/runner/key_means.py);
        `model`: one built and loaded already (an MTP head beside its model) instead of `model_path`'s.

        Each step needs the ones before it: the host check refuses a load that would not fit; the
        kernel passes time their candidates while the memory the KV cache will take is still free;
        the KV cache is sized last, on a GPU by a warm-up step through the chosen kernels and
        attention backend; the decode graphs are captured over the cache they will read."""
        self.config, self.hf_config, self.device, self.dtype = config, hf_config, device, dtype
        self.tp, self.workers = tp, workers
        self.block_size = config.kvcache_block_size
        self.vocab_size = hf_config.vocab_size
        torch.manual_seed(config.seed)
        self.packed_weights = device.type == "cpu" and can_pack_for_cpu(dtype)
        self.gguf = model_path if isinstance(model_path, GGUFCheckpoint) else None
        self.from_gguf = self.gguf is not None
        self.quantized = config.quantization is not None or self.from_gguf
        if device.type == "cpu" and model is None:
            check_weights_fit(model_path, config, hf_config, dtype.itemsize, self.packed_weights, tp.size)
        # What this process already holds on the GPU (another engine, say) is not this engine's weights.
        self._gpu_bytes_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.model = self._load_model(model_path) if model is None else model
        # Whether steps keep their hidden states for an MTP drafter (last_hidden), which then run uncompiled
        self.keep_hidden, self.last_hidden, self._hidden = False, None, None
        self.gguf = None  # its metadata holds the vocabulary's lists, which nothing needs past loading
        self.gemv_layers_by_rows, self.normed_layers = self._run_kernel_passes()
        self.attention_layers, self.backend = self._bind_attention_backend()
        # The torch reference backend reads lengths on the host, which a graph cannot replay: it runs eagerly.
        # A model whose steps decide on the host (a mixture of experts' loop) runs them eagerly too.
        self.static_decode = getattr(self.model, "static_decode", True)
        self.use_graphs = (
            device.type == "cuda" and not config.enforce_eager and self.backend.name != "torch" and self.static_decode
        )
        # KV-cache groups where the steps run eagerly: a captured or compiled decode step reads one block table
        split, strided = not self.use_graphs and tp.size == 1, self.backend.name == "torch"
        self.kv_groups, self.kv_layout = plan_kv_cache(self.attention_layers, self.block_size, dtype, split, strided)
        self._create_step_buffers()
        self.kv_cache, self.num_blocks = self._allocate_kv_cache()
        calibrate_key_means(self, tokenizer, config.max_model_len or hf_config.max_position_embeddings)
        chunk = batched_token_budget(config, device.type)
        self.max_model_len = fitting_max_model_len(
            config.max_model_len,
            hf_config.max_position_embeddings,
            self.kv_groups,
            self.num_blocks,
            self.block_size,
            chunk,
        )
        self.graphs = self._capture_graphs()
        self._start_compiling_decode()

    # ---- start-up steps, in the order __init__ runs them ----------------------------------------
    def _load_model(self, model_path) -> nn.Module:
        """The model built on the device in `dtype`, with its weights loaded, in eval mode."""
        max_position = self.config.max_model_len or self.hf_config.max_position_embeddings
        # A quantized model is built on the meta device, so no full-precision weight is ever allocated;
        # the quantization pass swaps its layers before the checkpoint's tensors stream in.
        with torch.device("meta" if self.quantized else self.device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                model = model_class(self.hf_config)(self.hf_config, max_position, self.tp)
            finally:
                torch.set_default_dtype(default_dtype)
        if self.quantized:
            target = quantization.KernelTarget(self.device, self.dtype, onednn=self.packed_weights)
            quantization.quantize(model, self.config.quantization, target, self.config.quantization_group_size)
            model.to_empty(device=self.device)
            for module in model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.init_caches(self.device)
        headless = self.config.runner == "pooling"  # an embedding model: its head never runs
        if self.gguf is not None:
            tensors = self.gguf.tensors()
            load_tensors(model, without_head(tensors) if headless else tensors, str(self.gguf.path))
        else:
            load_weights(model, model_path, headless)
        if self.quantized:
            quantization.finalize(model)
        model.eval()
        return model

    def _run_kernel_passes(self) -> tuple[dict[int, int], int]:
        """Pack the weights for oneDNN on the CPU; on a GPU, measure where the Triton GEMV and the
        norm fused into a projection beat the separate ops (engine/runner/kernel_passes.py). Returns,
        per row bucket, how many layers took the GEMV, and how many projections took the fused norm."""
        if self.packed_weights:
            pack_for_cpu(self.model)
        # the fused norm serves decode graphs (none under enforce_eager) over full-precision weights
        fuse_norms = not self.config.enforce_eager and not self.quantized
        return (
            choose_gemv(self.model, self.device, self.dtype),
            choose_normed(self.model, self.device, self.dtype) if fuse_norms else 0,
        )

    def _bind_attention_backend(self) -> tuple[list[Attention], AttentionBackend]:
        """The model's attention layers that hold a KV cache (not those reading another's), every attention layer
        set to run the configured backend's kernels."""
        attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        sinks, kv_dtype = any(layer.sinks is not None for layer in attention_layers), self.config.kv_cache_dtype
        backend = select_backend(
            self.config.attention_backend, self.device, self.dtype, self.block_size, sinks, kv_dtype
        )
        rotaries = layer_rotaries(self.model)
        for layer in attention_layers:
            layer.backend = backend
            layer.use_kv_format(kv_format(kv_dtype), self.device, rotaries.get(id(layer)))
        return [layer for layer in attention_layers if layer.kv_source is None], backend

    def _create_step_buffers(self) -> None:
        """The sampler, and the buffers each step's inputs and sampled tokens pass through."""
        config, device = self.config, self.device
        self.sampler = Sampler(self.vocab_size, device, compiled=device.type == "cuda" and not config.enforce_eager)
        # The CPU makes tensors of the host arrays without a copy; other devices take one transfer per dtype.
        dtypes = (torch.int64, torch.int32, torch.float32)
        self.staging = None if device.type == "cpu" else {t: StagingBuffer(device, t) for t in dtypes}
        # The last launched step's sampled tokens stay on the device: the next step may take its inputs from them.
        self.last_sampled: torch.Tensor | None = None
        self.last_sampled_rows = SampledRows([])
        # The last step's logprobs rows on the device (StepInputs' sample_logprobs_rows, prompt_logits_index,
        # prompt_token_ids), uploaded with its inputs; empty unless some request asked for logprobs.
        self.logprobs_rows: list[torch.Tensor] = []
        # Sampled tokens come back through two pinned buffers taking turns (StagingBuffer's mirror for
        # the way back): one step's are read while the next's arrive.
        self.readback, self.readback_done, self.readback_turn = None, None, 0
        if device.type == "cuda":
            rows = config.max_num_seqs * (1 + config.max_draft_tokens)  # a row per draft, and one more
            self.readback = [torch.empty(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.readback_done = [torch.cuda.Event() for _ in range(2)]

    def _allocate_kv_cache(self) -> tuple[list[torch.Tensor], int]:
        """The KV cache (keys and values of each layer, a tensor each) and its number of blocks
        (engine/runner/kv_cache.py); each attention layer is bound to its two. On a GPU without an explicit
        size, a warm-up step measures what is left."""

        # The recurrent state first (a hybrid model's): on a GPU the KV cache gets what it leaves
        self.state_slots = allocate_states(self.model, self.config, self.device, self.dtype)  # (running, snaps, bytes)
        layout, before = self.kv_layout, self._gpu_bytes_before
        measure = lambda: gpu_kv_budget(  # a warm-up step, run only where the GPU's free memory decides
            self.model, self.attention_layers, layout, self.config, self.device, before, self.use_graphs
        )
        num_blocks = choose_num_blocks(self.config, layout, self.device, self.tp, measure)
        # One more block than the block manager hands out, where the compiled decode steps are traced
        # and timed while requests may already be running.
        self.scratch_block = num_blocks if self._decode_compiles() else None
        extra = 0 if self.scratch_block is None else 1
        kv_cache = allocate_kv_cache(
            self.kv_layout, num_blocks + extra, self.attention_layers, self.device, self.kv_groups
        )
        return kv_cache, num_blocks

    def _capture_graphs(self) -> DecodeGraphs | None:
        """The decode steps' CUDA graphs, captured with the compiled small ops; None where steps run eagerly."""
        if not self.use_graphs:
            return None
        max_blocks, hidden = -(-self.max_model_len // self.block_size), self.hf_config.hidden_size
        graphs = DecodeGraphs(
            self.model, hidden, self.dtype, self.device, self.config.max_num_seqs, max_blocks, self.max_model_len,
            recurrent_state=self.state_slots[0] > 0,
        )  # fmt: skip
        with compiled_small_ops(self.model):
            graphs.capture()
        return graphs

    def _decode_compiles(self) -> bool:
        """Whether decode steps get compiled graphs: on the CPU, with one process and the torch attention backend, for
        a model whose steps decide nothing on the host, unless enforce_eager or PAGODA_CPU_COMPILE=0 says no."""
        return (
            self.device.type == "cpu"
            and self.static_decode
            and not self.config.enforce_eager
            and not compile_disabled_by_env()
            and self.tp.size == 1
            and self.backend.name == "torch"
            and self.kv_layout.uniform(self.attention_layers, self.kv_groups)  # no strided views: untried compiled
            and not self.state_slots[0]  # nor traced recurrent state
        )

    def _start_compiling_decode(self) -> None:
        """Trace and compile the decode steps in a background thread (runner/compiled_decode.py) that stops while the
        engine has requests (runner/background.py): a load is not held up by the compiler. The engine's thread then
        measures the graphs at its next `launch` (or in `wait_for_compiled_decode`) and keeps those that pay."""
        self.compiled_decode: CompiledDecode | None = None
        self.engine_activity = EngineActivity()
        self.compiled_decode_ready = threading.Event()
        self._captured: CompiledDecode | None = None  # compiled, not yet measured
        self._compiler: threading.Thread | None = None
        self._adopt_lock = threading.Lock()
        if self.graphs is not None:
            self.decode_kind = "cuda-graphs"
        elif self.scratch_block is None:
            self.decode_kind = "eager" if self.static_decode else "eager (its steps decide on the host)"
        else:
            self.decode_kind = "eager (compiling)"
            self._compiler = threading.Thread(target=self._compile_decode, name="pagoda-compile-decode", daemon=True)
            self._compiler.start()
            return
        self.compiled_decode_ready.set()

    @torch.inference_mode()
    def _compile_decode(self) -> None:
        yield_to_the_engine()
        args = (self.model, self.config.max_num_seqs, self.block_size, self.scratch_block, len(self.kv_groups.windows))
        try:  # published once this thread no longer stops for the engine, which joins it when adopting (None: closed)
            self._captured = self.engine_activity.run_when_idle(lambda: CompiledDecode(*args))
        except Exception as e:  # no C++ compiler, an op inductor cannot lower, a refused trace: still serve
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            log.warning(
                "decode steps run eagerly: compiling them failed (%s). They work, only slower; "
                "enforce_eager=True skips the attempt",
                reason,
            )
            self.decode_kind = "eager (compile failed)"
            self.compiled_decode_ready.set()

    @torch.inference_mode()
    def _adopt_compiled_decode(self) -> None:
        """Measure the compiled graphs in this thread and serve with those that pay."""
        with self._adopt_lock:
            captured, self._captured = self._captured, None
            if captured is None or self.model is None:  # adopted already, or released meanwhile
                return
            self._compiler.join()  # it has finished compiling; once it has ended its OpenMP workers are gone
            captured.choose()
            self.compiled_decode = captured if captured.graphs else None
            self.decode_kind = captured.describe()
            self.compiled_decode_ready.set()

    def wait_for_compiled_decode(self, timeout: float | None = None) -> bool:
        """Wait for the decode steps to compile, then measure them here (call it from the thread that
        steps the engine). Returns whether decode steps now run as they will from now on."""
        if self._compiler is not None:
            with self.engine_activity.engine_waiting():
                self._compiler.join(timeout)
        if self._captured is not None:
            self._adopt_compiled_decode()
        return self.compiled_decode_ready.is_set()

    def release(self) -> None:
        """Drop the weights, KV cache, graphs and step buffers; on a GPU, hand the freed memory back to
        the device. `launch` refuses to run afterwards."""
        self.graphs = self.compiled_decode = self._captured = self.model = self.kv_cache = self.last_sampled = None
        self.last_hidden = self._hidden = None
        self.attention_layers, self.last_sampled_rows, self.logprobs_rows = [], SampledRows([]), []
        self.staging = self.readback = None
        self.engine_activity.cancel()  # a compile still running stops at its next call
        if self._compiler is not None:
            self._compiler.join(timeout=60)
        give_back_freed_memory(self.device)

    # ---- one step -------------------------------------------------------------------------------
    def prepare(self, batch: list[ScheduledSeq], plan: LogprobsPlan | None = None) -> StepInputs:
        """This step's inputs as host arrays (engine/runner/step_inputs.py), for `to_device` to upload in one
        transfer per dtype. A pending input token is a placeholder there, filled on the device."""
        return prepare_step(batch, self.block_size, self.last_sampled_rows, plan)

    def upload(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """`arrays` as `dtype` tensors on this rank's device: views of one transfer off the CPU."""
        if not arrays:
            return []
        if self.staging is None:  # the CPU: arrays of the right dtype become tensors without a copy
            return [torch.from_numpy(np.ascontiguousarray(a)).to(dtype) for a in arrays]
        return self.staging[dtype].upload(arrays)

    def to_device(
        self, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions, attention metadata, logits rows, and the logprobs rows (sampled rows,
        prompt rows, prompt targets; empty unless asked for) as tensors on this rank's device."""
        (token_ids, positions, slots, logits_index, pending_rows, pending_sources, *logprobs_rows) = self.upload(
            [
                step.token_ids,
                step.positions,
                step.slot_mapping,
                step.logits_index,
                step.pending_rows,
                step.pending_sources,
                step.sample_logprobs_rows,
                step.prompt_logits_index,
                step.prompt_token_ids,
            ],
            torch.int64,
        )
        starts, seq_lens, tables, *group_tables = self.upload(
            [step.query_start_loc, step.seq_lens, step.block_tables, *step.group_block_tables], torch.int32
        )
        group_slots = self.upload(step.group_slot_mappings, torch.int64)
        if step.pending_rows.size:
            token_ids[pending_rows] = self.last_sampled[pending_sources]
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=int(step.query_lens.max()),
            max_seq_len=int(step.seq_lens.max()),
            query_lens_cpu=step.query_lens.tolist(),
            seq_lens_cpu=step.seq_lens.tolist(),
            state_slots_cpu=step.state_slots.tolist() if step.state_slots.size else None,
            state_restores=step.state_restores,
            state_snapshots=step.state_snapshots,
            state_writes_cpu=step.state_writes.tolist() if step.state_writes.size else None,
            state_waves_cpu=step.state_waves.tolist() if step.state_waves.size else None,
        )
        pairs = zip(group_slots, group_tables, strict=True)  # the other KV-cache groups': the same lengths
        return token_ids, positions, with_groups(meta, sum(pairs, ())), logits_index, logprobs_rows

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq]) -> LaunchedStep:
        """Enqueue one step: the forward, the sampling, and the copy of the sampled tokens to the
        host. On a GPU this returns while the device works; `collect` waits for the tokens."""
        if self.model is None:
            raise RuntimeError("this engine is closed; create a new LLM")
        if self._captured is not None:  # the graphs have compiled: measure them, once, between two steps
            self._adopt_compiled_decode()
        plan = logprobs_plan(batch)
        step = self.prepare(batch, plan)
        with MODULE_CALLS.eager_call():  # never inside a window of the decode compiler's tracing (runner/tracing.py)
            if self.workers is None:
                logits, prompt_logprobs = self.execute(step)
                if self.keep_hidden:
                    self.last_hidden, self._hidden = HiddenStates.of(batch, self._hidden), None
            else:
                with self.workers.guard():
                    self.workers.send_step(step)
                    logits, prompt_logprobs = self.execute(step)
            sample_logprobs = tokens = None
            if logits is not None:
                tokens = self._sample(logits, [s for s in batch if s.samples], step)
                if plan is not None and plan.sample_rows.size:
                    sample_logprobs = self._sample_logprobs(logits, tokens, step)
        if self.readback is None:  # the CPU: everything is computed already
            return LaunchedStep(batch, tokens, None, plan, sample_logprobs, prompt_logprobs)
        if plan is not None:  # copied before the event below, which then covers them too
            sample_logprobs = sample_logprobs.to_host() if sample_logprobs is not None else None
            prompt_logprobs = prompt_logprobs.to_host() if prompt_logprobs is not None else None
        if tokens is None:  # only prefill chunks that sample nothing; maybe their prompt logprobs
            ready = None
            if prompt_logprobs is not None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            return LaunchedStep(batch, None, ready, plan, None, prompt_logprobs)
        turn, self.readback_turn = self.readback_turn, 1 - self.readback_turn
        host = self.readback[turn][: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        self.readback_done[turn].record(torch.cuda.current_stream(self.device))
        return LaunchedStep(batch, host, self.readback_done[turn], plan, sample_logprobs, prompt_logprobs)

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledSeq], step: StepInputs) -> torch.Tensor:
        """The token each sampling row gets; where requests check drafts (speculative decoding), one per row of
        logits, -1 past a request's last (engine/sample/rejection.py)."""
        if step.draft_token_ids.size:  # speculation runs synchronously: no later step's input comes from these
            rows = self.sampler.prepare(
                [s.seq for s in sampling for _ in range(1 + len(s.draft_token_ids))], self.upload
            )
            self.last_sampled, self.last_sampled_rows = None, SampledRows([])
            return verify_drafts(logits, rows, *self.upload([step.draft_token_ids, step.draft_offsets], torch.int64))
        seqs = [s.seq for s in sampling]
        tokens = self.sampler(
            logits, self.sampler.prepare(seqs, self.upload, self.last_sampled, self.last_sampled_rows)
        )
        self.last_sampled, self.last_sampled_rows = tokens, SampledRows(seqs)
        return tokens

    def _sample_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, step: StepInputs) -> LogprobsTensors:
        """The raw logprobs of the sampled tokens of the rows that asked, from the logits they were sampled from."""
        if len(step.sample_logprobs_rows) < logits.shape[0]:  # only the rows that asked pay the log_softmax
            rows = self.logprobs_rows[0]
            logits, tokens = logits[rows], tokens[rows]
        return gather_logprobs(logits, tokens, step.num_logprobs)

    def collect(self, launched: LaunchedStep) -> list[int]:
        """The token sampled for each item of the launched step that samples; waits for the device (after
        which the step's logprobs, if any, are on the host too).
        Collect each step before launching the one after next: they share two host buffers."""
        if launched.ready is not None:
            launched.ready.synchronize()
        return [] if launched.tokens is None else launched.tokens.tolist()

    def execute(self, step: StepInputs) -> tuple[torch.Tensor | None, LogprobsTensors | None]:
        """This rank's forward pass of one step: on rank 0 the logits to sample (None if no row samples)
        and the prompt logprobs asked for (None if none); (None, None) on the other ranks.
        Call it under torch.inference_mode(), as `launch` and the worker loop do."""
        input_ids, positions, meta, logits_index, self.logprobs_rows = self.to_device(step)
        compiled = None if self.keep_hidden else self.compiled_decode  # its graphs return logits only
        if compiled is not None and not step.prompt_logits_index.size and compiled.can_run(meta, logits_index.numel()):
            return compiled.run(input_ids, positions, meta, logits_index), None
        hidden = self.forward(input_ids, positions, meta)
        self._hidden = hidden if self.keep_hidden else None
        prompt_logprobs = self._prompt_logprobs(hidden, step) if step.prompt_logits_index.size else None
        if logits_index.numel() == 0:
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[logits_index]), prompt_logprobs

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs) -> LogprobsTensors | None:
        """The logprobs of the prompt tokens at `step.prompt_logits_index`'s rows (engine/sample/logprobs.py)."""
        _, rows, targets = self.logprobs_rows
        return prompt_logprobs(
            self.model.compute_logits, hidden, rows, targets, step.num_prompt_logprobs, self.vocab_size
        )

    def parameter_bytes(self) -> int:
        """Bytes of the weights this rank holds (engine/runner/memory.py)."""
        return held_weight_bytes(self.model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)
