"""The C++ CPU kernels' library: a failed build leaves it off with a reason, loading it does
not change the process's floating-point mode, and every file it is built from keys its cache."""

from __future__ import annotations

import re

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


def test_every_header_the_kernels_include_is_in_the_builds_key():
    """An edited header must rebuild the library: a header missing from the key left a stale build."""
    included = {name for path in (*cpu_library.SOURCES, *cpu_library.HEADERS)
                for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included <= {path.name for path in cpu_library.HEADERS}
