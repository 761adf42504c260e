"""Replicas: how many engines a command runs on Ray, on which cluster, with what resources each
(`--replicas`, `--ray-address`, `--gpus-per-replica`, `--cpus-per-replica`, shared by `qrun
generate` and `qrun serve`), and connecting to Ray for them.

One replica and no address is the plain single-process path, which never imports ray.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from qrun.errors import QrunError

RAY_INSTALL_HINT = 'pip install -e ".[ray]"'
# A traceback's last line: the exception's (dotted) class name and its message.
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


@dataclass(frozen=True)
class ReplicaSpec:
    count: int
    address: str | None  # None: start a Ray instance on this machine
    cpus: float
    gpus: float | None  # None: one per replica if the cluster has GPUs, else none

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ReplicaSpec":
        return cls(args.replicas, args.ray_address, args.cpus_per_replica, args.gpus_per_replica)

    @property
    def on_ray(self) -> bool:
        return self.count > 1 or self.address is not None

    def check_ray_installed(self) -> None:
        """A QrunError saying what to install, if these replicas need Ray and it is missing."""
        if self.on_ray and importlib.util.find_spec("ray") is None:
            what = f"--replicas {self.count}" if self.count > 1 else "--ray-address"
            raise QrunError(f"{what} runs on Ray, which is not installed: {RAY_INSTALL_HINT}")


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas (on Ray: pip install -e \".[ray]\")")
    group.add_argument("--replicas", type=_positive_int, default=1, metavar="N",
                       help="run N engines on Ray, one per replica (default 1: this process, without Ray)")
    group.add_argument("--ray-address", metavar="ADDR",
                       help="the Ray cluster to run on (host:6379, or 'auto' for the one `ray start` made here); "
                            "default with --replicas > 1: a new Ray instance on this machine")
    group.add_argument("--cpus-per-replica", type=_non_negative_float, default=1.0, metavar="C",
                       help="CPUs Ray reserves for each replica; its engine runs that many threads (default 1)")
    group.add_argument("--gpus-per-replica", type=_non_negative_float, default=None, metavar="G",
                       help="GPUs Ray reserves for each replica (default: 1 if the cluster has GPUs, else 0)")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused below, with negatives and infinity
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def connect(spec: ReplicaSpec) -> ModuleType:
    """ray, connected to the spec's cluster (or to a new instance on this machine); a process
    already connected stays on its cluster."""
    import ray

    local = {} if spec.address else {"include_dashboard": False}  # a cluster of ours needs no dashboard
    ray.init(address=spec.address, ignore_reinit_error=True, logging_level=logging.WARNING, **local)
    return ray


def replicas_failed(report: str) -> QrunError:
    """Ray's report on replicas that failed (a traceback per attempt, each ending in the replica's
    own exception line, "qrun.errors.ModelLoadError: ...") as one line: the last such line."""
    for line in reversed(report.splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return QrunError(f"the replicas failed: {match.group(2)} ({match.group(1)}; Ray's log above has more)")
    return QrunError(f"the replicas failed: {' '.join(report.split())}")


def gpus_per_replica(spec: ReplicaSpec, ray: ModuleType) -> float:
    if spec.gpus is not None:
        return spec.gpus
    return 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def model_for_replicas(model: str) -> str:
    """A model path as every replica can open it: Ray starts workers in their own folder, so a
    relative path is made absolute (an alias or hub id stays as it is)."""
    path = Path(model)
    return str(path.resolve()) if path.exists() else model
