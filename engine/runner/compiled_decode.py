"""Decode steps on the CPU as compiled graphs: torch.compile's inductor, called directly.

Eager PyTorch pays a few microseconds of dispatch for every op, and a decoder layer at one row is
some forty small ops. On the bundled SmolLM2 (30 layers, Q4_1) 12 ms of a 16 ms eager step went to
dispatch, three times what its matmuls took. Compiled, the norms, rotary, residual adds, casts and
the KV gather fuse into a few C++ loops around the matmul and attention kernels.

Two graphs are traced at load: one row (static shapes), and 2..max_num_seqs rows (the row count a
symbol). In both the number of KV blocks read is a symbol; block tables get at least 2 columns,
since the compiler would specialise a size of 1. Each graph is then called directly with a flat
list of its inputs, not through torch.compile's wrapper, whose guard check over the ~400 weight
tensors took 1.2 ms a step (12% at 100 tok/s). Nothing it checks changes after load: the weights,
KV tensors and kernel modules are fixed, the step tensors keep their dtypes and layouts, and the
sizes that vary are the traced symbols. `capture` refuses a trace that assumed anything about them.

The ModelRunner builds this in a background thread after load, while steps run eagerly: the first
load of a model compiles for about a minute on two cores, later loads for seconds (inductor keeps
what it built in the user's cache folder). Then, in the thread that steps the engine, `choose`
measures each graph against the eager forward on the same inputs; a graph must agree with it and is
kept only where faster (`describe` says what was chosen, for stats()). The traces and timings write
only a scratch KV block that no request is given.
"""

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from engine.runner.tracing import decode_step_trace, fx_windows_guarded

log = logging.getLogger("engine")

# PAGODA_CPU_COMPILE=0 keeps every CPU step eager (as enforce_eager=True does): for test suites that
# build many small engines, where a compile per engine would cost more than it saves.
ENV_SWITCH = "PAGODA_CPU_COMPILE"
MIN_BLOCKS = 2
_TRACE_ROWS, _TRACE_BLOCKS = 2, 3  # distinct, so each traced symbol is known by its example size
_CAPTURE_LOCK = threading.Lock()  # captures share _forward's code object in torch.compile's cache


def compile_disabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def _forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    logits_index: torch.Tensor,
    *groups: torch.Tensor,
) -> torch.Tensor:
    """One decode step's logits: what each graph computes. The metadata's host fields are never read
    while compiling (engine/attention/torch_backend.py), so placeholders fill them. `groups`: the slot
    mapping and block tables of each KV-cache group after the first, in turn."""
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=slot_mapping,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=0,
        query_lens_cpu=[],
        seq_lens_cpu=[],
        host_lens_exact=False,
    )
    return model.compute_logits(model(input_ids, positions, with_groups(meta, groups))[logits_index])


def eager_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    logits_index: torch.Tensor,
    *groups: torch.Tensor,
) -> torch.Tensor:
    """`_forward`'s step run eagerly, with the host fields the eager attention reads: the reference."""
    rows = input_ids.shape[0]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=[1] * rows,
        seq_lens_cpu=seq_lens.tolist(),
    )
    return model.compute_logits(model(input_ids, positions, with_groups(meta, groups))[logits_index])


def with_groups(meta: AttentionMetadata, groups: tuple[torch.Tensor, ...]) -> AttentionMetadata:
    """`meta` with the KV-cache groups after the first: (slot_mapping, block_tables) pairs, flattened."""
    if groups:
        meta.groups = [meta] + [
            replace(meta, slot_mapping=slots, block_tables=tables, backend_cache={}, groups=None)
            for slots, tables in zip(groups[::2], groups[1::2], strict=True)
        ]
    return meta


@dataclass
class DecodeGraph:
    """One compiled graph and how to call it: `template` holds its fixed inputs (weights, KV tensors)
    in place; each step fills `step_slots` (position, index of the step tensor) and `size_slots`
    (position, "rows" or "blocks")."""

    fn: Callable
    template: list
    step_slots: list[tuple[int, int]]
    size_slots: list[tuple[int, str]]
    calls: int = 0

    def __call__(self, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        inputs = list(self.template)
        for position, index in self.step_slots:
            inputs[position] = args[index]
        sizes = {"rows": args[0].shape[0], "blocks": args[3].shape[1]}
        for position, name in self.size_slots:
            inputs[position] = sizes[name]
        self.calls += 1
        return self.fn(*inputs)[0]


class CaptureRefused(RuntimeError):
    """The trace cannot be called directly (it assumed something of the sizes, or broke into pieces)."""


def _check_guards(guards: list, hints: dict, max_rows: int) -> None:
    """Refuse a trace whose assumptions about its sizes do not hold for every step it will be called
    with. Each symbol stands for the rows or the blocks (known by its example size); an assumption
    that the row sizes of two inputs are equal holds for every step, one that rows < 128 (a branch
    taken) does not. Checked at the sizes steps take, from the smallest to the largest."""
    roles = {symbol: {_TRACE_ROWS: "rows", _TRACE_BLOCKS: "blocks"}.get(int(hint)) for symbol, hint in hints.items()}
    for expr in guards:
        unknown = [s for s in expr.free_symbols if roles.get(s) is None]
        if unknown:
            raise CaptureRefused(f"the trace assumed {expr}, about sizes other than the rows and blocks")
        for rows in sorted({_TRACE_ROWS, 3, 8, 64, max(max_rows, _TRACE_ROWS)}):
            for blocks in (MIN_BLOCKS, 3, 17, 1024):
                sizes = {"rows": rows, "blocks": blocks}
                if not bool(expr.xreplace({s: sizes[roles[s]] for s in expr.free_symbols})):
                    raise CaptureRefused(f"the trace assumed {expr}, false at {rows} rows and {blocks} blocks")


def capture(model: nn.Module, args: tuple[torch.Tensor, ...], dynamic_rows: bool, max_rows: int) -> DecodeGraph:
    """Trace and compile `_forward` on `args` (which it runs once), and return the compiled graph with
    its calling plan. Rows (when `dynamic_rows`) and blocks are traced as symbols."""
    from torch._inductor.compile_fx import compile_fx

    captured = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list):
        shape_env = torch._guards.TracingContext.get().fake_mode.shape_env
        # A C++ wrapper calls the graph's kernels without Python between them: 4% of a SmolLM2 step.
        compiled = compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": True})
        captured.append(
            (gm, list(example_inputs), compiled, [g.expr for g in shape_env.guards], dict(shape_env.backed_var_to_val))
        )
        return compiled

    for tables in (args[3], *args[7::2]):  # every KV-cache group's block tables
        torch._dynamo.mark_dynamic(tables, 1)
    if dynamic_rows:
        for t in args:
            torch._dynamo.mark_dynamic(t, 0)
    with _CAPTURE_LOCK:
        try:
            with decode_step_trace(), fx_windows_guarded():  # steps may run in another thread meanwhile
                torch.compile(_forward, backend=backend, fullgraph=True, dynamic=False)(model, *args)
        finally:
            # The graphs are called directly from here on; torch.compile's cache entry for this code
            # (guarded on this model) would only count towards its limit of entries per function.
            torch._dynamo.reset_code(_forward.__code__)
    if len(captured) != 1:
        raise CaptureRefused(f"the step compiled into {len(captured)} graphs, not one")
    gm, examples, compiled, guards, hints = captured[0]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if len(outputs) != 1:  # more outputs: side effects that torch.compile's wrapper would replay
        raise CaptureRefused(f"the step's graph has {len(outputs)} outputs, not one")
    _check_guards(guards, hints, max_rows)
    sizes = {_TRACE_ROWS: "rows", _TRACE_BLOCKS: "blocks"}
    template, step_slots, size_slots = [], [], []
    for position, x in enumerate(examples):
        if isinstance(x, torch.SymInt | int):
            value = x.node.hint if isinstance(x, torch.SymInt) else x
            if value not in sizes:
                raise CaptureRefused(f"the trace has a size input of {value} that is neither rows nor blocks")
            size_slots.append((position, sizes[value]))
            template.append(None)
        elif (index := next((i for i, a in enumerate(args) if a is x), None)) is not None:
            step_slots.append((position, index))
            template.append(None)
        else:
            template.append(x)  # a weight, KV tensor or table: the same object every step
    return DecodeGraph(compiled, template, step_slots, size_slots)


def example_args(
    rows: int, blocks: int, block_size: int, scratch_block: int, num_groups: int = 1
) -> tuple[torch.Tensor, ...]:
    """A decode step of `rows` rows at positions 0..rows-1, all in `scratch_block`, a block no sequence
    uses: input_ids, positions, slot_mapping, block_tables, seq_lens, logits_index, then the slot mapping
    and block tables of each further KV-cache group."""
    positions = torch.arange(rows)
    slots = lambda: scratch_block * block_size + positions
    tables = lambda: torch.full((rows, blocks), scratch_block, dtype=torch.int32)
    groups = [t for _ in range(num_groups - 1) for t in (slots(), tables())]
    return (
        torch.zeros(rows, dtype=torch.int64),
        positions,
        slots(),
        tables(),
        (positions + 1).to(torch.int32),
        torch.arange(rows),
        *groups,
    )


def _seconds_per_call(fn: Callable[[], torch.Tensor], calls: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class CompiledDecode:
    """The compiled graphs of one model's decode steps: traced and compiled on construction (in a
    background thread), then `choose` keeps those that measure faster than eager."""

    def __init__(self, model: nn.Module, max_num_seqs: int, block_size: int, scratch_block: int, num_groups: int = 1):
        """Traces the steps in `scratch_block`, a KV block outside the block manager's, so the engine
        may run requests meanwhile (from another thread). `num_groups`: the model's KV-cache groups."""
        self.model, self.max_num_seqs = model, max_num_seqs
        self.graphs: dict[str, DecodeGraph] = {}  # "one row", "rows": the ones `choose` kept
        self.candidates: dict[str, tuple[DecodeGraph, tuple[torch.Tensor, ...]]] = {}
        self.notes: list[str] = []
        start = time.perf_counter()
        self._set_cache_dir()
        shapes = [("one row", 1, False)] + ([("rows", _TRACE_ROWS, True)] if max_num_seqs > 1 else [])
        for name, rows, dynamic in shapes:
            args = example_args(rows, _TRACE_BLOCKS, block_size, scratch_block, num_groups)
            self.candidates[name] = (capture(model, args, dynamic, max_num_seqs), args)
        self.notes.append(f"compiled in {time.perf_counter() - start:.1f} s")

    def choose(self) -> None:
        """Keep each graph that agrees with the eager step and runs it faster. Call it in the thread
        that steps the engine, once the compiling thread has ended: the timings then see OpenMP's
        workers as the steps will (engine/front/engine_thread.py's note on them)."""
        for name, (graph, args) in self.candidates.items():
            if self._measure(name, self.model, graph, args) is not None:
                self.graphs[name] = graph
        self.candidates = {}
        log.info("decode steps: %s (%s)", self.describe(), "; ".join(self.notes))

    def _measure(
        self, name: str, model: nn.Module, graph: DecodeGraph, args: tuple[torch.Tensor, ...]
    ) -> DecodeGraph | None:
        """`graph` if it agrees with the eager step on `args` and runs it faster, else None."""

        def eager() -> torch.Tensor:
            return eager_forward(model, *args)

        reference, got = eager(), graph(args).float()
        # Half-precision eager steps round every op's output and the graph rounds only what it stores:
        # on SmolLM2 in bf16 the eager logits were 7.5 off float32's (of 28), the graph's 0.8. So the
        # bound is loose there, and the most likely token must agree as well. So where a kernel rounds its
        # input to int8 per block: a value the graph fuses differently can round to the next step, and a
        # random-weight Qwen3-4B's logits moved by 0.19 (of 4.9) through 36 layers, against 1e-6 in float32.
        rounds = reference.dtype in (torch.bfloat16, torch.float16) or any(
            getattr(m, "rounds_activations", False) for m in model.modules()
        )
        share = 0.35 if rounds else 0.02
        reference = reference.float()
        error = (got - reference).abs().max().item()
        if error > share * reference.abs().max().item() + 1e-3 or not torch.equal(got.argmax(-1), reference.argmax(-1)):
            self.notes.append(f"{name}: disagrees with eager by {error:.3g}")
            log.warning("the compiled decode graph (%s) disagrees with the eager step by %.3g; not used", name, error)
            return None
        compiled_s, eager_s = _seconds_per_call(lambda: graph(args)), _seconds_per_call(eager)
        self.notes.append(f"{name}: {eager_s * 1e3:.2f} ms eager, {compiled_s * 1e3:.2f} ms compiled")
        return graph if compiled_s < eager_s else None

    @staticmethod
    def _set_cache_dir() -> None:
        """Inductor's cache lives in /tmp by default, which a reboot empties; keep it with the user's caches."""
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            import platformdirs

            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(platformdirs.user_cache_path("pagoda") / "torchinductor")

    def describe(self) -> str:
        """ "compiled (1 row, 2-256 rows)", "compiled (1 row)", or "eager" when no graph was kept."""
        kept = [{"one row": "1 row", "rows": f"2-{self.max_num_seqs} rows"}[n] for n in self.graphs]
        return f"compiled ({', '.join(kept)})" if kept else "eager"

    def can_run(self, meta: AttentionMetadata, num_logits: int) -> bool:
        """A step of decode rows only, each sampling (the graphs compute every row's logits)."""
        rows = meta.num_seqs
        return (
            meta.max_query_len == 1
            and num_logits == rows
            and rows <= self.max_num_seqs
            and ("one row" if rows == 1 else "rows") in self.graphs
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits_index: torch.Tensor
    ) -> torch.Tensor:
        """The step's logits (see `can_run`)."""

        def padded(block_tables: torch.Tensor) -> torch.Tensor:
            if block_tables.shape[1] < MIN_BLOCKS:  # -1 entries: read as block 0 and masked out
                block_tables = F.pad(block_tables, (0, MIN_BLOCKS - block_tables.shape[1]), value=-1)
            return block_tables

        groups = [t for g in (meta.groups or [meta])[1:] for t in (g.slot_mapping, padded(g.block_tables))]
        # Layouts as traced: the graphs were compiled for contiguous inputs.
        args = tuple(
            t.contiguous()
            for t in (input_ids, positions, meta.slot_mapping, padded(meta.block_tables), meta.seq_lens, logits_index)
        ) + tuple(t.contiguous() for t in groups)
        return self.graphs["one row" if input_ids.shape[0] == 1 else "rows"](args)


def yield_to_the_engine() -> None:
    """Give this thread (and the OpenMP workers and compiler processes it starts, which inherit it) the lowest
    CPU priority: on a laptop's few cores, a compile at the engine's priority took half of every core while the
    first requests ran, and their OpenMP workers, descheduled mid-step, waited on each other. Measured on 2 cores
    (bench/first_token.py): a 4B file's first token, 100 prompt tokens, 17.4 s with the compile beside it."""
    if sys.platform.startswith("linux"):  # where a thread's id names it to setpriority (elsewhere: the process's)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError as e:
            log.info("could not lower the decode compile's priority (%s)", e)
