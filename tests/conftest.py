"""Shared fixtures: tiny random checkpoints made on the spot, and the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

if not os.path.exists("/dev/nvidiactl"):
    # Without a GPU the Triton kernels run in the interpreter. Triton reads this when first
    # imported, so it is set before anything imports qrun (which imports triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Engines run eager unless a test asks for compiled decode steps: compiling each test's tiny model
# would cost seconds per engine.
os.environ.setdefault("QRUN_ENFORCE_EAGER", "1")

import qrun  # noqa: E402,F401
import torch  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_checkpoint(root / family, family) for family in ("llama", "qwen2", "mistral")}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def tiny_llama64_dir(tmp_path_factory) -> Path:
    """The tiny Llama with heads of 64, a size the C++ CPU attention takes (compiled steps run it)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny64") / "llama", "llama", head_dim=64)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    """Calibration text for converting tiny models: held-in Brown text, or a stand-in without ../shared."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    source = SHARED / "data" / "text" / "brown_a_press_reportage.txt"
    path.write_text(source.read_text()[:20000] if source.is_file() else "The quick brown fox jumps over the lazy dog. " * 500)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from qrun.sources import fetch_alias

    return fetch_alias("smollm2-135m")


@pytest.fixture(scope="session")
def workload():
    """Requests of the mixed-length benchmark workload, in file order."""
    path = SHARED / "data" / "workloads" / "mixed_lengths.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


SUMMARY_LINES = pytest.StashKey[list]()


@pytest.fixture
def summary_line(request):
    """Adds a line to the end of the run's report: what a test measured, shown even when it passes."""
    return request.config.stash.setdefault(SUMMARY_LINES, []).append


def pytest_terminal_summary(terminalreporter, config) -> None:
    for line in config.stash.get(SUMMARY_LINES, []):
        terminalreporter.write_line(line)


def pytest_configure(config) -> None:
    # Two cores: more threads only contend. Tests compare numbers, never time, so the engine's
    # load-following thread count is fixed too (subprocesses inherit it): a count changing
    # between two runs a test compares could change their last bits.
    threads = min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    os.environ.setdefault("QRUN_THREADS", str(threads))
