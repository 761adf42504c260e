"""Where a qrun engine step's time goes: a torch profile of a few steps of a workload, with the
matmuls, attention and sampling labelled, and the Python overhead outside torch ops.

Used by `bench_serving.py --profile`; on its own:

    python scripts/profile_steps.py smollm2-135m --num-requests 8 --steps 8
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from qrun.bench import BenchRequest, load_workload
from qrun.sampling_params import SamplingParams


# The profiler labels' namespace: not `qrun::`, the C++ kernels' ops (torch.ops.qrun.*), which are torch ops to count.
LABEL = "step::"
# Linears besides nn.Linear: the mixed-bit layer and the CPU path's products (qrun/quant.py, qrun/cpu_linear.py).
LINEARS = ("QuantLinear", "CpuDenseLinear", "CpuQuantMatmul")


class LabelledOps:
    """Stands in for a model's kernel-ops object, labelling attention calls for the profiler."""

    def __init__(self, ops, label: str):
        self._ops, self._label = ops, label

    def __getattr__(self, name):
        import torch

        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(self._label):
                return fn(*args, **kwargs)
        return wrapped


@contextmanager
def labelled_model(engine) -> Iterator[None]:
    """Label matmuls (Linear/QuantLinear modules, the LM head), attention ops and sampling."""
    import torch
    import qrun.llm_engine as llm_engine

    model = engine.loaded.model
    handles, patched = [], []
    active: dict[int, Any] = {}

    def pre(module, args):
        rf = torch.profiler.record_function(LABEL + "matmul")
        rf.__enter__()
        active.setdefault(id(module), []).append(rf)

    def post(module, args, output):
        active[id(module)].pop().__exit__(None, None, None)

    labelled: list[str] = []  # linears labelled so far: one inside another (a CPU product in its QuantLinear) is not
    for name, module in model.named_modules():
        if ((isinstance(module, torch.nn.Linear) or type(module).__name__ in LINEARS)
                and not any(name.startswith(outer + ".") for outer in labelled)):
            labelled.append(name)
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        if hasattr(module, "ops") and type(module).__name__ == "Attention":
            patched.append((module, module.ops))
            module.ops = LabelledOps(module.ops, LABEL + "attention")
    original_sample = llm_engine.sample

    def sample(*args, **kwargs):
        with torch.profiler.record_function(LABEL + "sample"):
            return original_sample(*args, **kwargs)
    llm_engine.sample = sample
    try:
        yield
    finally:
        llm_engine.sample = original_sample
        for module, ops in patched:
            module.ops = ops
        for handle in handles:
            handle.remove()


def profile_qrun(llm, requests: Sequence[BenchRequest], *, steps: int = 8, skip_steps: int = 4,
                 top: int = 15) -> dict:
    """Profile `steps` engine steps (after `skip_steps`) of the workload; abort the rest.

    Returns the top ops by self CPU time and the wall-time split: matmul (Linear modules and the
    LM head, including any dequantization inside them), attention (rotary, KV store, paged
    attention), sampling, other torch ops, and Python overhead = wall − time inside torch ops.
    """
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    engine.block_manager.reset_prefix_cache()
    ids = [f"profile-{time.monotonic_ns()}-{i}" for i in range(len(requests))]
    for request_id, r in zip(ids, requests):
        engine.add_request(request_id, r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                ignore_eos=True))
    try:
        for _ in range(skip_steps):
            engine.step()
        batch_tokens: list[int] = []
        observe = lambda step: batch_tokens.append(step.scheduled_tokens)  # noqa: E731
        engine.step_observers.append(observe)
        try:
            with labelled_model(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                wall = time.perf_counter() - t0
        finally:
            engine.step_observers.remove(observe)
    finally:
        for request_id in ids:
            engine.abort(request_id)
    events = prof.key_averages()
    labels = {e.key: e.cpu_time_total / 1e6 for e in events if e.key.startswith(LABEL)}
    ops = [e for e in events if not e.key.startswith(LABEL) and not e.key.startswith("ProfilerStep")]
    in_torch = sum(e.self_cpu_time_total for e in ops) / 1e6
    matmul, attention, sampling = (labels.get(LABEL + k, 0.0) for k in ("matmul", "attention", "sample"))
    # Torch ops under a label = the label's inclusive time minus its own (Python glue) time.
    under_labels = sum(e.cpu_time_total - e.self_cpu_time_total for e in events if e.key.startswith(LABEL)) / 1e6
    other_torch = max(0.0, in_torch - under_labels)
    top_ops = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "steps": steps,
        "tokens_per_step": batch_tokens,
        "wall_s": wall,
        "torch_ops_s": in_torch,
        "python_overhead_s": max(0.0, wall - in_torch),
        "python_overhead_share": max(0.0, wall - in_torch) / wall,
        "matmul_s": matmul,
        "attention_s": attention,
        "sample_s": sampling,
        "other_torch_s": other_torch,
        "top_ops": [{"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count,
                     "share_of_wall": e.self_cpu_time_total / 1e6 / wall} for e in top_ops],
    }


def format_profile(p: dict) -> str:
    wall = p["wall_s"]
    lines = [f"profile: {p['steps']} steps, tokens/step {p['tokens_per_step']}, wall {wall * 1e3:.1f} ms",
             f"  matmul (Linear + LM head, incl. dequant) {p['matmul_s'] / wall:6.1%}   "
             f"attention (rotary+store+paged) {p['attention_s'] / wall:6.1%}   sampling {p['sample_s'] / wall:6.1%}",
             f"  all torch ops {p['torch_ops_s'] / wall:6.1%}   Python overhead (outside torch ops) "
             f"{p['python_overhead_share']:6.1%}",
             f"  {'op':<44} {'self ms':>9} {'calls':>7} {'% wall':>7}"]
    for op in p["top_ops"]:
        lines.append(f"  {op['op'][:44]:<44} {op['self_cpu_s'] * 1e3:9.2f} {op['calls']:7d} {op['share_of_wall']:7.1%}")
    return "\n".join(lines)


def main() -> None:
    from bench_serving import DEFAULT_WORKLOAD

    from qrun import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps profiled (after 4 unprofiled ones)")
    args = parser.parse_args()
    llm = LLM(args.model)
    print(format_profile(profile_qrun(llm, load_workload(args.workload, args.num_requests), steps=args.steps)))


if __name__ == "__main__":
    main()
