"""A Triton kernel launch described before it runs.

Every launcher builds its launches with a pure planning function (shapes, dtypes and the
device's size in, `Launch` objects out) and then runs them. The ahead-of-time check
(`qrun.kernels.aot`) calls the same planning functions on meta tensors and compiles what they
return for GPUs this machine does not have, so the configurations it proves are exactly the
ones the launchers use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from triton.runtime.autotuner import Autotuner

# Shared memory one block may use, in bytes (the opt-in maximum), by CUDA compute capability.
MAX_SHARED_MEMORY = {75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
DEFAULT_SHARED_MEMORY = 101376  # no device to ask (the interpreter): a consumer card's limit


@dataclass
class Launch:
    """`kernel[grid](*args, **constexprs, **options)`, kept as data until `run`."""

    kernel: Any  # a triton JITFunction, Autotuner or (TRITON_INTERPRET=1) InterpretedFunction
    grid: tuple[int, ...] | Callable[[dict], tuple[int, ...]]
    args: tuple
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)  # num_warps / num_stages; none when interpreted

    @property
    def jit_function(self) -> Any:
        """The kernel itself, out of its Autotuner if it has one."""
        return self.kernel.fn if isinstance(self.kernel, Autotuner) else self.kernel

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def is_interpreted(kernel: Any) -> bool:
    """Whether `kernel` (a @triton.jit function) runs in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return type(kernel).__name__ == "InterpretedFunction"


def gpu_options(kernel: Any, **options: int) -> dict[str, int]:
    """`options` for a compiled kernel; the interpreter takes none."""
    return {} if is_interpreted(kernel) else options


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: Any) -> int:
    """Streaming multiprocessors of `device` (a torch.device); 8 in the interpreter, small so
    that the split-K heuristics are exercised there."""
    if getattr(device, "type", None) != "cuda":
        return 8
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_FITS: dict[tuple, bool] = {}


def fits_device(launch: Launch, device: Any) -> bool:
    """Whether `launch` compiles for `device` (a torch.device) within its shared memory and
    without spilling registers; compiled once per distinct kernel variant (Triton then keeps
    the binary for the launch itself). Always True in the interpreter."""
    kernel = launch.jit_function
    if is_interpreted(kernel):
        return True
    # Asked on every launch of a layer: a key of the objects themselves, no formatting (a
    # launcher always lists its constexprs and options in the same order).
    key = (device, kernel, tuple(a.dtype for a in launch.args if hasattr(a, "dtype")),
           tuple(launch.constexprs.values()), tuple(launch.options.values()))
    if key not in _FITS:
        from triton.runtime.errors import OutOfResources

        compiled = kernel.warmup(*launch.args, grid=(1,), **launch.constexprs, **launch.options)
        try:
            compiled._init_handles()  # loads the binary: sets n_spills, raises past the shared memory
            _FITS[key] = compiled.n_spills == 0 and compiled.metadata.shared <= max_shared_memory(device)
        except OutOfResources:
            _FITS[key] = False
    return _FITS[key]


def max_shared_memory(device: Any) -> int:
    """Shared memory one block may use on `device` (a torch.device), in bytes."""
    if getattr(device, "type", None) != "cuda":
        return DEFAULT_SHARED_MEMORY
    import torch

    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return optin or MAX_SHARED_MEMORY.get(props.major * 10 + props.minor, DEFAULT_SHARED_MEMORY)
