"""The engine: requests in, one scheduled step at a time, text out.

Offline: `LLM(model).generate(prompts, params)`. Online: `add_request`, `step`, `abort_request`,
with `stats()` and `kv_blocks()` for dashboards. Not thread-safe: one thread drives it.

On a GPU, steps are scheduled asynchronously: `step()` launches the next step before it reads
back the previous one, so the host's Python (scheduling, inputs, detokenizing, stop checks) runs
while the device computes instead of between its steps. Each `step()` then returns the outputs
of the step before. A request that stops on a token (eos, a stop string) has already been given
one more step, whose token is dropped; a length limit is known in advance and costs nothing.

With `tensor_parallel_size=N > 1`, this process is rank 0 and N-1 worker processes hold the rest
of the model; `close()` stops them (garbage collection and interpreter exit do too).
"""

import logging
import threading
from itertools import count

import torch

from engine.config import EngineConfig, batched_token_budget
from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledSeq, Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.state_slots import StateSlots
from engine.front.detokenizer import Detokenizer
from engine.front.introspection import engine_stats, kv_block_map
from engine.front.model_files import eos_token_ids, open_model
from engine.front.output_processor import finish_reason, request_output, speculation_of, take_logprobs
from engine.front.outputs import EmbeddingOutput, EngineStats, KVBlock, RequestOutput
from engine.front.pooling import embed_prompts, pooling_config, resolve_runner, set_up_pooling
from engine.front.sampling_params import SamplingParams
from engine.loader import GGUFCheckpoint, checkpoint_dtype, pick_device, pick_dtype
from engine.runner.distributed import check_tensor_parallel
from engine.runner.model_runner import LaunchedStep, ModelRunner
from engine.sample.structured_output import Grammar, StructuredOutputs
from engine.spec_decode.speculator import make_speculator

log = logging.getLogger("engine")


class StepFailed(RuntimeError):
    """A step raised: its requests (`request_ids`) were aborted and their KV blocks freed; the engine serves on."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


def _breaks_the_device(error: BaseException) -> bool:
    """Errors after which no later step can be trusted: CUDA's are sticky (every later call fails too)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("CUDA error", "CUBLAS_STATUS", "device-side assert", "illegal memory access")
    )


# Loads in one process take turns: two at once would each measure the free memory the other is about to take,
# and race in transformers' lazy imports (an embedding model loading beside the app's chat model failed so).
_LOADS = threading.Lock()


class LLMEngine:
    def __init__(self, model: str, **settings):
        with _LOADS:
            self._load(model, settings)

    def _load(self, model: str, settings: dict) -> None:
        self.config = config = EngineConfig.from_kwargs(str(model), **settings)
        path, hf_config, tokenizer = open_model(config)
        config.runner = resolve_runner(config.runner, path, hf_config)
        self.pooling = pooling_config(path, hf_config) if config.runner == "pooling" else None
        if self.pooling is not None:
            set_up_pooling(config, hf_config)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(
            config.dtype, self.device, quantized=isinstance(path, GGUFCheckpoint) or bool(config.quantization)
        )
        if config.dtype == "auto":
            log.info(
                "dtype auto: using %s on %s (checkpoint stores %s)",
                self.dtype,
                self.device,
                checkpoint_dtype(hf_config),
            )
        check_tensor_parallel(config.tensor_parallel_size, hf_config, self.device)  # before anything is spawned
        if self.device.type == "cuda" and config.speculative is not None and config.speculative.method == "draft":
            from engine.spec_decode.draft_loader import leave_room_for_the_draft

            leave_room_for_the_draft(config, self.device)
        self.workers = None
        self._worker_parameter_bytes: list[int] = []
        if config.tensor_parallel_size == 1:
            self.model_runner = ModelRunner(config, hf_config, path, self.device, self.dtype, tokenizer=tokenizer)
        else:
            self._start_tensor_parallel(hf_config, path)
        self.tokenizer = tokenizer.result()
        self.max_model_len = self.model_runner.max_model_len
        running, snapshots, _ = self.model_runner.state_slots
        states = (
            StateSlots(running, snapshots, config.state_snapshot_tokens, config.max_draft_tokens) if running else None
        )
        self.block_manager = BlockManager(
            self.model_runner.num_blocks,
            config.kvcache_block_size,
            config.enable_prefix_caching,
            self.model_runner.kv_groups.windows,
            states,
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, batched_token_budget(config, self.device.type)
        )
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = eos_token_ids(path, hf_config, self.tokenizer)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model_runner.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._request_ids = count()
        self.num_generated_tokens = 0
        self.max_batch_size = 0  # see EngineStats.max_batch_size
        try:
            self.speculator = make_speculator(config.speculative, self)
        except BaseException:  # a draft that fails to load: the target's memory goes back now
            self.model_runner.release()
            raise
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = (
                self.device.type == "cuda"
                and config.tensor_parallel_size == 1
                and self.model_runner.backend.name != "torch"
                and self.speculator is None  # a step's drafts come from the tokens of the step before
            )
        self._in_flight: LaunchedStep | None = None  # launched, not yet read back (async scheduling)
        self._stepping: list[Sequence] = []  # the requests of the step being run (what a failure aborts)

    def _start_tensor_parallel(self, hf_config, path) -> None:
        from engine.runner.tp_workers import WorkerPool

        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)  # rank r runs on GPU r
        self.workers = WorkerPool(self.config, hf_config, path, self.device, self.dtype)
        try:
            with self.workers.guard():
                self.model_runner = ModelRunner(
                    self.config, hf_config, path, self.device, self.dtype, tp=self.workers.group, workers=self.workers
                )
            self._worker_parameter_bytes = self.workers.wait_ready()
        except BaseException:
            self.workers.close()
            raise

    def close(self) -> None:
        """Release what the engine holds: its weights, KV cache and CUDA graphs (on a GPU, the memory
        goes back to the device, so another engine can load, as when the app swaps models), and the
        tensor-parallel worker processes, if any. The engine runs no more steps; `stats()` still
        answers. Safe to call more than once."""
        if self.workers is not None:
            self.workers.close()
        self._in_flight = None
        self.model_runner.release()
        if self.speculator is not None:
            self.speculator.proposer.release()

    def parameter_bytes(self) -> list[int]:
        """Bytes of model weights each rank holds, rank 0 first: about 1/N of the model each."""
        return [self.model_runner.parameter_bytes(), *self._worker_parameter_bytes]

    # ---- requests -------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.model_runner.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.model_runner.vocab_size - 1})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "and at least one new token must fit; shorten the prompt or raise max_model_len"
            )
        return token_ids

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """Token ids of a conversation through the model's own chat template, ending where the
        assistant's reply starts. The one place a chat becomes tokens: the app's chats and the API's
        requests go through it, so the same system prompt gives the same leading ids, and so the
        same prefix-cache blocks. `template_kwargs` go to the template (e.g. enable_thinking)."""
        if self.tokenizer.chat_template is None:
            raise ValueError("this model has no chat template, so it cannot take a conversation; send a plain prompt")
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        grammar: Grammar | None = None,
    ) -> str:
        """Queue a request and return its id. Invalid requests raise and change nothing. `priority`: vLLM's,
        lower is more urgent; a step serves only the most urgent requests present (engine/core/scheduler.py).
        `grammar`: the request's constraint compiled beforehand (`compile_constraint`), else compiled here."""
        if self.pooling is not None:
            raise ValueError(
                f"{self.config.model} is an embedding model: it makes vectors with embed(), not text; load a chat "
                "model to generate"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int (lower is more urgent; 0 is the default), got {priority!r}")
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        vocab = self.model_runner.vocab_size
        for field, ids in (
            ("logit_bias", sampling_params.logit_bias or {}),
            ("stop_token_ids", sampling_params.stop_token_ids),
        ):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise ValueError(f"{field} names token ids {outside[:5]} outside the vocabulary (0..{vocab - 1})")
        seq = Sequence(
            self.encode_prompt(prompt),
            sampling_params,
            request_id or f"req-{next(self._request_ids)}",
            self.max_model_len,
            priority,
        )
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if grammar is not None:
            seq.grammar = grammar
        elif sampling_params.structured_outputs is not None:
            seq.grammar = self.compile_constraint(sampling_params)
        if sampling_params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(sampling_params.seed)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._note_activity()
        return seq.request_id

    def compile_constraint(self, sampling_params: SamplingParams) -> Grammar | None:
        """The request's structured-output constraint as a fresh matcher (None without one). Safe to call from any
        thread while the engine steps: a large constraint takes a second or more to compile the first time."""
        if sampling_params.structured_outputs is None:
            return None
        return self.structured_outputs.grammar(sampling_params.structured_outputs)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks. False if it is unknown or already finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        if self.speculator is not None:  # a draft model's copy of it lets go of its blocks too
            self.speculator.proposer.retain(self.scheduler.running)
        self._note_activity()
        return True

    def prefill_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens in the KV cache, prompt tokens) while the request reads its prompt, cached tokens
        included (a preempted one starts again from what it recomputes); None once its first token is out,
        or for an unknown request. A long paste takes seconds to read on a CPU: this is what shows it."""
        seq = self.requests.get(request_id)
        if seq is None or seq.num_output_tokens or seq.num_pending_tokens:
            return None
        return min(seq.num_computed_tokens, seq.num_prompt_tokens), seq.num_prompt_tokens

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def _note_activity(self) -> None:
        """Background work (the CPU decode compile, a draft model's too) runs only while no request is unfinished
        (runner/background.py)."""
        busy = self.has_unfinished_requests()
        self.model_runner.engine_activity.set_busy(busy)
        draft_runner = self.speculator.proposer.runner if self.speculator is not None else None
        if draft_runner is not None:
            draft_runner.engine_activity.set_busy(busy)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every running request. A step that raises aborts the requests it ran (their KV blocks
        are freed) and raises StepFailed naming them; the engine goes on with the others. An error that leaves
        the device or the model in doubt (a CUDA error, tensor-parallel workers out of step) is raised as it
        is: the engine must then be loaded again."""
        in_flight, self._stepping = self._in_flight, []
        try:
            return self._step()
        except Exception as e:
            ran = {seq.request_id for seq in self._stepping}
            ran |= {item.seq.request_id for item in in_flight.batch} if in_flight is not None else set()
            if not ran or self.model_runner.workers is not None or _breaks_the_device(e):
                raise
            log.exception("a step failed; its requests %s are aborted, and the engine goes on", sorted(ran))
            self._in_flight = None
            for request_id in ran:
                self.abort_request(request_id)
            raise StepFailed(sorted(ran), e) from e
        finally:
            self._note_activity()

    def _step(self) -> list[RequestOutput]:
        drained = []
        in_flight = self._in_flight
        if in_flight is not None and any(item.samples and item.seq.grammar is not None for item in in_flight.batch):
            # A constrained request's next mask needs the token in flight: read it back before planning.
            drained, self._in_flight = self._finish(in_flight), None
        batch = self.scheduler.schedule()
        self._stepping = [item.seq for item in batch]
        self.max_batch_size = max(self.max_batch_size, len(batch))
        launched = self._launch(batch) if batch else None
        if self.async_scheduling:  # read back the step before, while the device runs this one
            launched, self._in_flight = self._in_flight, launched
        return drained + (self._finish(launched) if launched else [])

    def _launch(self, batch) -> LaunchedStep:
        launched = self.model_runner.launch(batch)
        for item in batch:  # what the step will have done, so the next one can be planned now
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            # Blocks this step fills may be shared from now on: every step that could read them runs
            # after this one on the device. A block whose last token is pending waits for `_finish`.
            if not seq.num_pending_tokens:
                self.block_manager.register_full_blocks(seq)
            seq.num_pending_tokens += item.samples
        return launched

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Take in a launched step's sampled tokens (waiting for them) and advance its requests."""
        tokens = self.model_runner.collect(launched)
        sampled = iter(tokens)  # a token per sampling item; with drafts, one per row (engine/sample/rejection.py)
        logprobs = iter(take_logprobs(launched, tokens) if launched.logprobs_plan else ())
        outputs = []
        for item in launched.batch:
            if not item.samples:
                continue
            seq, new_tokens = item.seq, [next(sampled) for _ in range(1 + len(item.draft_token_ids))]
            token_logprobs = next(logprobs) if seq.output_logprobs is not None else None
            seq.num_pending_tokens -= 1
            if seq.is_finished:  # it stopped, or was aborted, while this step ran: drop the token
                continue
            if item.draft_token_ids:
                new_tokens = self._take_accepted(item, new_tokens)
            for token in new_tokens:
                seq.token_ids.append(token)
                if seq.grammar is not None:
                    seq.grammar.consume(token, seq.request_id)
                if token_logprobs is not None:
                    seq.output_logprobs.append(token_logprobs)
                if len(seq.token_ids) <= seq.num_computed_tokens:  # it was pending, and a launched step's input
                    self.block_manager.register_full_blocks(seq)  # so a block waiting for it may be complete
                self.num_generated_tokens += 1
                outputs.append(self._advance(seq, token, token_logprobs))
                if seq.is_finished:  # on a stop token or string among accepted drafts: the rest is not the reply
                    break
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _take_accepted(self, item: ScheduledSeq, row_tokens: list[int]) -> list[int]:
        """The tokens a request gets from a step that checked its drafts: the accepted ones and one more. The KV of
        the rejected drafts is given up: the next step writes over it. The blocks the accepted ones fill are
        registered as they are appended, as a pending token's are."""
        new_tokens = row_tokens[: row_tokens.index(-1)] if -1 in row_tokens else row_tokens
        item.seq.num_computed_tokens -= len(row_tokens) - len(new_tokens)
        accepted = len(new_tokens) - 1
        if item.verify_slots and accepted < len(item.draft_token_ids):  # a recurrent state: back to its last accepted
            item.seq.restore_slot = item.verify_slots[accepted]  # token's, when its next step starts
        self.speculator.record(item.seq, len(item.draft_token_ids), len(new_tokens) - 1)
        return new_tokens

    def _advance(self, seq: Sequence, token: int, token_logprobs: dict[int, float] | None = None) -> RequestOutput:
        reason = finish_reason(seq, token, self.eos_token_ids, self.detokenizer)
        if reason is not None:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            self.scheduler.remove(seq)
            self.requests.pop(seq.request_id, None)
        return request_output(seq, token, reason, token_logprobs)

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return engine_stats(self)

    def kv_blocks(self) -> list[KVBlock]:
        """One entry per KV block, in block id order (see KVBlock)."""
        return kv_block_map(self.block_manager, self.scheduler.running)

    # ---- offline API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[dict]:
        """Complete every prompt; one dict per prompt, in order, with text, token_ids and finish_reason.
        `priority`: one per prompt, as vLLM takes it (see add_request). Waits first for the CPU decode
        steps to compile, if they still are (engine/runner/compiled_decode.py)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(
                f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
            )
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} sampling params for {len(prompts)} prompts; give one, or one per prompt"
            )
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt")
        encoded = [self.encode_prompt(p) for p in prompts]  # validate everything before queuing anything
        if not self.model_runner.compiled_decode_ready.is_set():
            # An offline batch runs at the speed its decode steps were chosen for; the online front
            # (EngineThread) serves eagerly meanwhile instead.
            log.info("waiting for the decode steps to compile (engine/runner/compiled_decode.py)")
            self.model_runner.wait_for_compiled_decode()
        seqs = [
            self.requests[self.add_request(e, p, priority=rank)]
            for e, p, rank in zip(encoded, params, priority, strict=True)
        ]
        for s in seqs:
            s.stream_text = False
        bar = None
        if use_tqdm and len(seqs) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while any(not s.is_finished for s in seqs):
                finished = sum(out.finished for out in self.step())
                if bar and finished:
                    bar.update(finished)
        except BaseException:
            for s in seqs:  # leave the engine clean for the next call
                self.abort_request(s.request_id)
            raise
        finally:
            if bar:
                bar.close()
        return [
            {
                "text": s.output_text,
                "token_ids": s.output_token_ids,
                "finish_reason": s.finish_reason,
                "num_prompt_tokens": s.num_prompt_tokens,
                "num_cached_tokens": s.num_cached_tokens,
                "logprobs": s.output_logprobs,
                "prompt_logprobs": s.prompt_logprobs,
                "error": s.grammar.failure if s.finish_reason == "error" else None,
                "speculation": speculation_of(s),  # (steps that checked drafts, drafted, accepted), or None
            }
            for s in seqs
        ]


class LLM(LLMEngine):
    """vLLM's offline entry point: `LLM(model, **settings).generate(prompts, sampling_params)`, and for an
    embedding model `LLM(model).embed(inputs)`."""

    def embed(self, prompts, dimensions: int | None = None, truncate: bool = False) -> list[EmbeddingOutput]:
        """One embedding per input (a string or token ids), in order. `dimensions`: the vectors cut to that length,
        where the model was trained for it (engine/front/pooling.py); `truncate`: an input longer than the model
        reads is cut to its first tokens, not refused."""
        return embed_prompts(self, prompts, dimensions, truncate)
