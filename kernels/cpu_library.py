"""The C++ kernels for CPUs, built into one library of torch ops at first use.

The kernels (cpu_activation.cpp, cpu_argmax.cpp, cpu_attention.cpp, cpu_draw.cpp, cpu_half_gemv.cpp,
cpu_int4.cpp, cpu_kv_store.cpp, cpu_logprobs.cpp, cpu_norm.cpp, cpu_quant_matmul.cpp, cpu_quant_matmul_amx.cpp,
cpu_rotary.cpp, cpu_rotation.cpp, cpu_token_bitmask.cpp, and cpu_read.cpp, the benchmark's read-bandwidth probe)
are plain C++; cpu_ops.cpp registers them as `torch.ops.qrun.*` (schema, CPU and, for the model's, Meta
implementations), so eager code reaches them with one dispatch (~1.5 us for an empty op; the Python op around a
ctypes call it replaces took ~10 us, and a decode step makes ~150 such calls) and a compiled graph keeps each as one
call.
cpu_model.cpp is a decoder layer's step (decode rows and prefill chunks) as one object calling them
(`torch.classes.qrun.StepLayer`), and a model's whole step, embedding to logits, as another
(`StepModel`: qrun/cpu_model.py). Built with the
machine's C++ compiler (the names Inductor looks for) for this CPU (-march=native) against the running
torch's headers, and cached under qrun's cache folder keyed by the sources, flags, compiler, torch and
CPU: ~25 s once.
It links the OpenMP runtime torch has loaded (same soname), so its parallel loops run on torch's
threads rather than on a second pool fighting them for the cores. Floating point is IEEE apart from
reassociation (vectorised sums): no -ffast-math, whose startup code would switch the whole process
to flush-to-zero.

Where there is no compiler or the build fails, `available()` is False (with a warning saying
why) and the kernel table keeps the torch references (`qrun.kernels.ops_for`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch
import torch.utils.cpp_extension

from qrun.atomic import atomic_path

log = logging.getLogger("qrun")

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_activation.cpp", "cpu_argmax.cpp", "cpu_attention.cpp", "cpu_draw.cpp",
                             "cpu_half_gemv.cpp", "cpu_int4.cpp", "cpu_kv_store.cpp", "cpu_logprobs.cpp",
                             "cpu_norm.cpp", "cpu_quant_matmul.cpp", "cpu_quant_matmul_amx.cpp", "cpu_read.cpp",
                             "cpu_rotary.cpp", "cpu_rotation.cpp", "cpu_team.cpp", "cpu_token_bitmask.cpp",
                             "cpu_ops.cpp", "cpu_model.cpp"))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # in the build's key with the sources
# QRUN_CPU_ARCH: another -march than this CPU's (native), e.g. x86-64-v3 to run the kernels' AVX2 paths on a CPU with
# AVX-512 (with ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2 for torch's own: its
# float32 matmuls are MKL's, which the other two leave on AVX-512).
_FLAGS = ("-O3", f"-march={os.environ.get('QRUN_CPU_ARCH', 'native')}", "-fno-math-errno", "-fassociative-math",
          "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp", "-std=c++20", "-shared", "-fPIC",
          f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")

_lock = threading.Lock()
_loaded = False
_failed = False


def cpp_compiler() -> str | None:
    """The C++ compiler found on PATH (the names Inductor looks for), None without one."""
    return next((path for name in ("g++", "c++", "clang++") if (path := shutil.which(name))), None)


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _torch_flags() -> list[str]:
    lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{path}" for path in torch.utils.cpp_extension.include_paths()]
    return [*includes, f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]


def _build() -> None:
    from qrun.sources import cache_dir  # qrun's cache folder (imported late: kernels load before the engine)

    compiler = cpp_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = b"\0".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(b"\0".join([sources, " ".join(_FLAGS).encode(),
                                     version.encode(), torch.__version__.encode(), _cpu_id().encode()]))
    target = cache_dir() / "kernels" / f"qrun_cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            built = subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), *_torch_flags(), "-o", str(tmp)],
                                   capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"{compiler} failed to build the CPU kernels:\n{built.stderr[-2000:]}")
    torch.ops.load_library(str(target))


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own check; absent from torch means unknown: no)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private in torch
    return check is not None and check()


def available() -> bool:
    """Whether the C++ kernels run here: `torch.ops.qrun.*` are loaded (the first call builds
    them: ~15 s once per machine and torch version)."""
    global _loaded, _failed
    with _lock:
        if not _loaded and not _failed:
            try:
                _build()
                _loaded = True
            except (OSError, RuntimeError) as err:
                _failed = True
                log.warning("C++ CPU kernels unavailable, running torch's (slower): %s", err)
        return _loaded
