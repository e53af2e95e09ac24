"""Pagoda's own CPU kernel (grouped_int8.cpp), compiled on first use for the CPU that runs it.

PyTorch's weight-only int4 kernel is bound by its arithmetic on a CPU, so GGUF's 5-, 6- and 8-bit types, which
it takes as two or four 4-bit terms, cost two or four times a 4-bit weight. grouped_int8.cpp multiplies their
8-bit codes as they are, one exact integer dot product per group. It is built with torch's C++ extension tools and
-march=native into the user's cache folder (a few seconds, once per machine and source), and registered as
the operator `torch.ops.pagoda_cpu.grouped_int8_mm`, which compiled decode steps call like any other.

Opt-in for now (PAGODA_NATIVE_KERNELS=1): measured on a 2-core AVX-512 VM (bench/RESULTS.md), it is 3x faster
than the two-term int4 product with the weight in cache (13 against 42 us at 576 x 576), but a model's weights
come from memory, where both read the same byte a weight and run at the memory's speed: the SmolLM2 Q4_K_M file
decoded alike in eager steps (37 against 34 tok/s) and slower in compiled ones (60 against 71), whose call of a
custom operator costs more. The lever left is fewer bytes: Q5_0's codes in 5 bits, not 8.

Without the switch, a C++ compiler or ninja, `grouped_int8_mm()` is None and the kernel is not offered:
PyTorch's kernels serve.
"""

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.quantization.kernels import QuantizedMatmul, dequantize_looked_up, round_up
from engine.quantization.layout import QuantizedWeight

log = logging.getLogger("engine")

SOURCE = Path(__file__).with_name("grouped_int8.cpp")
_LOCK = threading.Lock()
_BUILT: dict[str, object] = {}  # "op": the operator, or None once building it failed
_FAKE_REGISTERED = []  # torch takes one fake per operator and process, however often the switch is flipped


def _machine_tag() -> str:
    """What -march=native compiles for: the build of one CPU is never loaded on another sharing the folder."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags += next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        pass
    source = SOURCE.read_bytes()
    return hashlib.sha256(flags.encode() + source + torch.__version__.encode()).hexdigest()[:12]


def _build_dir() -> Path:
    import platformdirs

    folder = platformdirs.user_cache_path("pagoda") / "kernels" / f"grouped_int8-{_machine_tag()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _put_ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the pip package's binary sits beside this Python, which
    a launcher-started app runs without its folder on PATH."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def grouped_int8_mm():
    """The compiled operator, built on first call; None where it cannot be built here (said once in the log)."""
    with _LOCK:
        if "op" not in _BUILT:
            _BUILT["op"] = _build()
        return _BUILT["op"]


def _build():
    if os.environ.get("PAGODA_NATIVE_KERNELS", "0") != "1":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # the kernel's fast paths are x86's; elsewhere PyTorch's kernels serve
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()

        flags = ["-O3", "-march=native"] if os.name != "nt" else ["/O2", "/arch:AVX2"]
        load(
            name="pagoda_grouped_int8",
            sources=[str(SOURCE)],
            extra_cflags=flags,
            build_directory=str(_build_dir()),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a build error: the kernel is not offered
        log.warning(
            "Pagoda's CPU int8 kernel could not be built (%s); PyTorch's kernels serve. It needs a C++ "
            "compiler and ninja.",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return None
    if not _FAKE_REGISTERED:

        @torch.library.register_fake("pagoda_cpu::grouped_int8_mm")
        def _(x, codes, scale, offset, group):
            return x.new_empty((x.shape[0], codes.shape[0]))

        _FAKE_REGISTERED.append(True)
    return torch.ops.pagoda_cpu.grouped_int8_mm


class GroupedInt8Matmul(QuantizedMatmul):
    """Codes as bytes in groups of 16 or 32 columns, multiplied by Pagoda's native kernel: the row
    is rounded to 16-bit integers per group (a step of 1/32767 of the group's largest value, finer than bf16),
    and each group's product is exact in integers. 4-bit codes c become c - 8 with the offset made up."""

    GROUPS = (16, 32)

    @staticmethod
    def applies(qw: QuantizedWeight, device: torch.device) -> bool:
        return device.type == "cpu" and qw.group_size in GroupedInt8Matmul.GROUPS and grouped_int8_mm() is not None

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qw)
        self.dtype = dtype
        n, k = qw.shape
        self.padded_k = round_up(k, 32)
        groups = self.padded_k // qw.group_size
        pad = lambda m: F.pad(m.float(), (0, groups - m.shape[1])).contiguous()
        codes, offset = qw.q, qw.offset
        if qw.bits == 4:  # q * s + o = (q - 8) * s + (o + 8 s)
            codes = (qw.q.to(torch.int16) - 8).to(torch.int8)
            offset = 8 * qw.scale + (0 if qw.offset is None else qw.offset)
        self.codes = F.pad(codes, (0, self.padded_k - k)).contiguous()
        self.scale = pad(qw.scale)
        self.offset = None if offset is None else pad(offset)
        self.op = grouped_int8_mm()

    def dequantized_bf16(self) -> torch.Tensor:
        g, k = self.group_size, self.in_features
        w = self.codes[:, :k].float() * self.scale.repeat_interleave(g, dim=1)[:, :k]
        if self.offset is not None:
            w += self.offset.repeat_interleave(g, dim=1)[:, :k]
        return w.to(torch.bfloat16)

    def looked_up_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_looked_up(
            self.codes[ids],
            8,
            self.scale[ids],
            None if self.offset is None else self.offset[ids],
            self.group_size,
            self.in_features,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.float().contiguous(), self.codes, self.scale, self.offset, self.group_size).to(self.dtype)
