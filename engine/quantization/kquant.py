"""Pagoda's K-quant CPU kernel (kquant.cpp): x W^T straight from GGUF's Q4_K, Q5_K and Q6_K blocks (and the 32-value
blocks of Q8_0, MXFP4, Q4_0 and Q4_1, x then rounded per 32 columns) as the file stores them, so that a loaded model
holds those weights at their file size (issue 38; MXFP4: gpt-oss's experts, issue 30).

PyTorch's int4 kernel reads Q6_K as four 4-bit terms (2.5 bytes a weight where the file has 0.82) and Q5_K as two
(1.25 against 0.69): a Q4_K_M file's weights took about twice the file. This kernel keeps each row's blocks as
they are and unpacks one row at a time per thread into a few KB, multiplying it by every row of x; the activations
are rounded to int8 per 256 columns as llama.cpp's q8_K (or kept in float32: PAGODA_KQUANT_ACT=f32).

Built with torch's C++ extension tools on first use, into the user's cache folder, for the CPU that runs it:
-march=native by default, or AVX2 and FMA only with PAGODA_KQUANT_ISA=avx2 (what the bench uses to measure an AVX2
machine on an AVX-512 one). PAGODA_KQUANT_KERNELS=0 turns it off. Without a C++ compiler or ninja the kernel is
not offered, which the log says once, and PyTorch's kernels serve (at their larger layouts).
"""

import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization import native
from engine.quantization.kernels import QuantizedMatmul
from engine.quantization.layout import QuantizedWeight
from engine.runner.tracing import tracing_decode_step

log = logging.getLogger("engine")

SOURCE = Path(__file__).with_name("kquant.cpp")
KINDS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "Q8_0": 3, "MXFP4": 4, "Q4_0": 5, "Q4_1": 6}  # kquant.cpp's block kinds
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34, "MXFP4": 17, "Q4_0": 18, "Q4_1": 20}
BLOCK_VALUES = {"Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "Q8_0": 32, "MXFP4": 32, "Q4_0": 32, "Q4_1": 32}
ISAS = ("native", "avx2")
ACTS = {"int8": 0, "f32": 1}
# Prefill: from `dense_from_rows` rows of x up (chosen per shape by the chooser's `choose_prefill_rows`, as for
# PyTorch's kernels), a tile of the weight's rows at a time is dequantized to bf16 and multiplied by oneDNN; the tile
# keeps the expansion to a few MB, never a second copy of the weight.
TILE_BYTES = 4 << 20  # bf16 weight bytes dequantized per tile

_LOCK = threading.Lock()
_BUILT: dict[str, object] = {}  # isa -> the ops namespace, or None once building it failed
_FAKES: set[str] = set()


def enabled() -> bool:
    return os.environ.get("PAGODA_KQUANT_KERNELS", "1") != "0"


def isa_setting() -> str:
    isa = os.environ.get("PAGODA_KQUANT_ISA", "native")
    if isa not in ISAS:
        raise ValueError(f"PAGODA_KQUANT_ISA must be one of {ISAS}, not {isa!r}")
    return isa


def act_setting() -> str:
    act = os.environ.get("PAGODA_KQUANT_ACT", "int8")
    if act not in ACTS:
        raise ValueError(f"PAGODA_KQUANT_ACT must be one of {tuple(ACTS)}, not {act!r}")
    return act


def _flags(isa: str) -> list[str]:
    march = "-march=native" if isa == "native" else "-march=haswell"  # haswell: AVX2, FMA, no AVX-512
    # -fopenmp: ATen's parallel_for is inline, and without it runs every row on the calling thread alone
    return ["-O3", march, "-fopenmp", f"-DPAGODA_KQ_NS=pagoda_kquant_{isa}"]


def _build_dir(isa: str) -> Path:
    import platformdirs

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu += next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    tag = hashlib.sha256(
        cpu.encode() + SOURCE.read_bytes() + torch.__version__.encode() + " ".join(_flags(isa)).encode()
    ).hexdigest()[:12]
    folder = platformdirs.user_cache_path("pagoda") / "kernels" / f"kquant-{isa}-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def ops(isa: str | None = None):
    """The compiled operators for `isa` (the setting's by default), built on first call; None where they cannot be
    built here (said once in the log) or are turned off."""
    isa = isa or isa_setting()
    if not enabled():
        return None
    with _LOCK:
        if isa not in _BUILT:
            _BUILT[isa] = _build(isa)
        return _BUILT[isa]


def _build(isa: str):
    if platform.machine().lower() not in ("x86_64", "amd64") or os.name == "nt":
        return None  # the kernel's fast paths are x86's; elsewhere PyTorch's kernels serve
    name = f"pagoda_kquant_{isa}"
    try:
        folder = _build_dir(isa)  # named by the source, flags, torch and CPU: a library there is this build
        if (folder / f"{name}.so").is_file():
            # loaded as it is: torch's extension builder imports setuptools and more, 30-70 MB a load would keep
            torch.ops.load_library(str(folder / f"{name}.so"))
        else:
            from torch.utils.cpp_extension import load

            native._put_ninja_on_path()
            load(
                name=name,
                sources=[str(SOURCE)],
                extra_cflags=_flags(isa),
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a build error: the kernel is not offered
        log.warning(
            "Pagoda's K-quant CPU kernel could not be built (%s); PyTorch's kernels serve, holding Q4_K, "
            "Q5_K and Q6_K weights at up to 3x their file size. It needs a C++ compiler and ninja.",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return None
    namespace = getattr(torch.ops, name)
    if name not in _FAKES:  # shapes for compiled graphs: decode steps call the kernel and a tied table's lookup
        block = {KINDS[t]: (BLOCK_BYTES[t], BLOCK_VALUES[t]) for t in KINDS}
        torch.library.register_fake(f"{name}::kquant_mm")(
            lambda x, blocks, kind, act: x.new_empty((x.shape[0], blocks.shape[0]))
        )
        torch.library.register_fake(f"{name}::kquant_dequant")(
            lambda blocks, kind: blocks.new_empty(
                (blocks.shape[0], blocks.shape[1] // block[kind][0] * block[kind][1]), dtype=torch.float32
            )
        )
        _FAKES.add(name)
    log.info("K-quant CPU kernel built for %s (%d-bit vectors)", isa, namespace.kquant_isa(torch.zeros(1)))
    return namespace


def dequantize_blocks(blocks: torch.Tensor, source: str, isa: str | None = None) -> torch.Tensor:
    """Rows of GGUF blocks [rows, row bytes] as float32 [rows, K]."""
    return ops(isa).kquant_dequant(blocks.contiguous(), KINDS[source])


def block_rows(holder) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`rows(ids)`: rows of the K-quant weight in `holder.blocks` (of type `holder.source`) in float32, where this
    kernel serves it; None elsewhere."""
    blocks = getattr(holder, "blocks", None)
    if blocks is None or holder.source not in KINDS or blocks.device.type != "cpu" or ops() is None:
        return None
    namespace, kind = ops(), KINDS[holder.source]
    return lambda ids: namespace.kquant_dequant(blocks[ids].contiguous(), kind)


class KQuantMatmul(QuantizedMatmul):
    """A weight in its GGUF blocks (`QuantizedWeight.blocks`: Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, Q4_0, Q4_1), multiplied
    by kquant.cpp."""

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return (
            device.type == "cpu"
            and qw.source in KINDS
            and getattr(qw, "blocks", None) is not None
            and qw.shape[1] % BLOCK_VALUES[qw.source] == 0
            and ops() is not None
        )

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype, isa: str | None = None, act: str | None = None):
        super().__init__(qw)
        self.dtype = dtype
        self.kind = KINDS[qw.source]
        self.isa, self.act = isa or isa_setting(), act or act_setting()
        self.rounds_activations = self.act == "int8"
        self.blocks = qw.blocks.contiguous()
        if tuple(self.blocks.shape) != (qw.shape[0], qw.shape[1] // BLOCK_VALUES[qw.source] * BLOCK_BYTES[qw.source]):
            raise ValueError(f"{qw.source} blocks of shape {tuple(self.blocks.shape)} do not hold a {qw.shape} weight")
        self.ops = ops(self.isa)
        self.tile_rows = max(1, TILE_BYTES // (2 * self.in_features))

    def dequantized_bf16(self) -> torch.Tensor:
        """The whole weight in bf16: for the chooser's measurement on a proxy of a few rows; a model's kernel
        multiplies tile by tile instead (`tiled`)."""
        return self.ops.kquant_dequant(self.blocks, self.kind).to(torch.bfloat16)

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.kquant_dequant(self.blocks[ids].contiguous(), self.kind)

    def tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T by oneDNN's bf16 product, a tile of W's rows dequantized at a time."""
        x = x.to(torch.bfloat16)
        return torch.cat(
            [
                F.linear(
                    x,
                    self.ops.kquant_dequant(self.blocks[start : start + self.tile_rows], self.kind).to(torch.bfloat16),
                )
                for start in range(0, self.out_features, self.tile_rows)
            ],
            dim=-1,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # as QuantizedMatmul.__call__, but a tile at a time: not inside a compiled decode step (symbolic rows)
        if self.dense_from_rows is not None and not tracing_decode_step() and x.shape[0] >= self.dense_from_rows:
            return self.tiled(x).to(self.dtype)
        return nn.Module.__call__(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.kquant_mm(x.float().contiguous(), self.blocks, self.kind, ACTS[self.act]).to(self.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", GGUF blocks, {self.isa}, {self.act} activations"
