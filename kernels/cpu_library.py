"""The C++ kernels for CPUs (cpu_attention.cpp, cpu_int4.cpp), built into one library at first use.

Built with the machine's C++ compiler (the names Inductor looks for) for this CPU
(-march=native), and cached under qrun's cache folder keyed by the sources, flags, compiler
and CPU: ~3 s once. It links the OpenMP runtime torch has loaded (same soname), so its parallel
loops run on torch's threads rather than on a second pool fighting them for the cores. Floating
point is IEEE apart from reassociation (vectorised sums): no -ffast-math, whose startup code would
switch the whole process to flush-to-zero.

Where there is no compiler or the build fails, `available()` is False (with a warning saying
why) and the kernel table keeps the torch references (`qrun.kernels.ops_for`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import platform
import shutil
import subprocess
import threading
from pathlib import Path

from qrun.atomic import atomic_path

log = logging.getLogger("qrun")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_attention.cpp", "cpu_int4.cpp"))
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fopenmp", "-std=c++17", "-shared", "-fPIC")
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "qrun_decode_attention": (_I, *[_P] * 7, _I64, _P, _P, *[_I64] * 6, ctypes.c_float, _I),
    "qrun_dequantize_int4pack": (_P, _P, _P, _I64, _I64, _I64, _I64, _I, _I),
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
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


def _build() -> ctypes.CDLL:
    from qrun.sources import cache_dir  # qrun's cache folder (imported late: kernels load before the engine)

    compiler = cpp_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([*(source.read_bytes() for source in SOURCES), " ".join(_FLAGS).encode(),
                                     version.encode(), _cpu_id().encode()]))
    target = cache_dir() / "kernels" / f"qrun_cpu-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(target) as tmp:
            built = subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), "-o", str(tmp)], capture_output=True,
                                   text=True)
            if built.returncode != 0:
                raise RuntimeError(f"{compiler} failed to build the CPU kernels:\n{built.stderr[-2000:]}")
    library = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return library


def library() -> ctypes.CDLL | None:
    """The built library (building it on the first call), None where it cannot be built."""
    global _library, _failed
    with _lock:
        if _library is None and not _failed:
            try:
                _library = _build()
            except (OSError, RuntimeError) as err:
                _failed = True
                log.warning("C++ CPU kernels unavailable, running torch's (slower): %s", err)
        return _library


def available() -> bool:
    """Whether the C++ kernels run here (the first call may build them: ~3 s)."""
    return library() is not None
