"""Compile Triton kernel launches for an NVIDIA GPU on a machine that has none.

Triton's interpreter checks what a kernel computes, but not that Triton's compiler accepts it
for a GPU (constexpr use, dtypes, layouts), nor what it costs in registers. The compiler itself
needs no GPU: given a target it lowers a kernel to PTX and a cubin. So tests record the launches
the engine's own wrappers make under the interpreter (`record_launches`), and this module, run
as `python -m tests.gpu_compile SPECS.json` in a process without TRITON_INTERPRET (where the
kernels are real JIT functions), compiles each and prints what the cubin uses, as JSON. It
compiles with the Triton installed here, which may be newer than a GPU machine's.
"""

import json
import os
import subprocess
import sys
from contextlib import contextmanager

import torch

# Launch arguments that only the interpreter is given: a GPU launch passes the other value.
GPU_VALUES = {"UPCAST_DOT": False}
TARGET = ("cuda", 90, 32)  # Hopper (H100, H200): the device machine's GPU, and the default
# Other targets a spec may name in its "target": laptop and desktop RTX 30 (Ampere) and RTX 40 (Ada) GPUs.
TARGETS = {"sm_86": ("cuda", 86, 32), "sm_89": ("cuda", 89, 32), "sm_90": TARGET}

_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
    torch.int8: "*i8",
    torch.bool: "*i1",
}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def _divisible_by_16(value) -> bool:
    """What Triton's launcher tells the compiler of an argument: a pointer aligned to 16 bytes, or
    an integer that is a multiple of 16, lets it vectorise loads. A GPU launch marks them so, and
    code compiled without the marks is another kernel (twice the registers, scalar loads)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


@contextmanager
def record_launches(specs: list[dict]):
    """Append a spec to `specs` for each kernel launched meanwhile (run under TRITON_INTERPRET)."""
    from triton.runtime.interpreter import InterpretedFunction

    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        annotations = self.fn.__annotations__  # tl.constexpr, or its name where annotations are strings
        constexprs = {n: GPU_VALUES.get(n, v) for n, v in values.items() if "constexpr" in str(annotations.get(n))}
        signature = {n: "constexpr" if n in constexprs else _arg_type(v) for n, v in values.items()}
        divisible = [n for n, v in values.items() if n not in constexprs and _divisible_by_16(v)]
        specs.append(
            {
                "module": self.fn.__module__,
                "kernel": self.fn.__name__,
                "signature": signature,
                "constexprs": constexprs,
                "divisible_by_16": divisible,
                "num_warps": kwargs.get("num_warps", 4),
                "num_stages": kwargs.get("num_stages", 3),
            }
        )
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield specs
    finally:
        InterpretedFunction.run = real_run


def compile_in_subprocess(specs: list[dict], tmp_path) -> list[dict]:
    """Each distinct spec compiled for its "target" (a TARGETS value; TARGET when it names none) in a
    fresh process; one result per spec: the spec's kernel, its target, `error` (None when it
    compiled) and the cubin's `registers` and `local_bytes` (spills: local memory and stack)."""
    unique = list({json.dumps(s, sort_keys=True): s for s in specs}.values())
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(unique))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default, said out loud (it warns otherwise)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_compile", str(path)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the compile process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _resource_usage(cubin: bytes) -> dict:
    import re
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    # A spill shows as LOCAL, or as a STACK frame of local memory where the compiler keeps arrays it cannot
    # hold in registers
    found = re.search(r"REG:(\d+) STACK:(\d+).*LOCAL:(\d+)", out)
    return {"registers": int(found[1]), "local_bytes": int(found[2]) + int(found[3])} if found else {}


def _compile_all(specs: list[dict]) -> list[dict]:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for spec in specs:
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        target = GPUTarget(*spec.get("target", TARGET))
        result = {"kernel": spec["kernel"], "constexprs": spec["constexprs"], "target": target.arch, "error": None}
        try:
            attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec["divisible_by_16"]}
            source = ASTSource(fn=kernel, signature=spec["signature"], constexprs=spec["constexprs"], attrs=attrs)
            compiled = triton.compile(
                source, target=target, options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]}
            )
            result.update(_resource_usage(compiled.asm["cubin"]), shared_bytes=compiled.metadata.shared)
        except Exception as e:  # reported, so that the test names every kernel that fails
            cause = e.__cause__ or e.__context__  # where the compiler failed inside a helper it called
            because = f"\ncaused by {type(cause).__name__}: {str(cause)[-1500:]}" if cause is not None else ""
            result["error"] = f"{type(e).__name__}: {str(e)[-2000:]}{because}"
        results.append(result)
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(_compile_all(json.load(f))))
