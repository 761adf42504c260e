"""The C++ CPU kernels' library: a failed build leaves it off with a reason, and loading it does
not change the process's floating-point mode."""

from __future__ import annotations

import pytest
import torch

from qrun.kernels import cpu_library


def test_a_failed_build_says_why_and_leaves_the_kernel_off(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("QRUN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_library, "_loaded", False)
    monkeypatch.setattr(cpu_library, "_failed", False)
    monkeypatch.setattr(cpu_library, "cpp_compiler", lambda: None)
    assert not cpu_library.available()
    assert "no C++ compiler" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(not cpu_library.available(), reason="no C++ compiler")
def test_loading_the_kernel_keeps_subnormal_floats():
    """The library must not switch the process to flush-to-zero (what -ffast-math's startup code
    does when a shared library is linked with it)."""
    assert cpu_library.available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() > 0
