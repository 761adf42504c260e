"""scripts/soak.py, bounded for CI: a live `qrun serve` of a tiny model through a mixed load with
clients walking away, a full queue and preemptions, and every end-of-soak check holding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import soak  # noqa: E402


def test_soak_leaves_no_request_without_one_outcome_and_nothing_leaked(tiny_llama_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"request {i}: " + "the brown fox " * (i % 7 + 1)}) + "\n"
                               for i in range(20)))
    # 12 clients for 4 engine slots and 4 queue places: some get 429. A float32 cache of 312
    # tokens (512 bytes each) holds one request of the mix but not four: preemption.
    code = soak.main([str(tiny_llama_dir), "--requests", "120", "--concurrency", "12", "--prompts", str(prompts),
                      "--max-num-seqs", "4", "--max-queue", "4", "--kv-cache-memory", "160000", "--seed", "1",
                      "--", "--device", "cpu", "--kv-cache-dtype", "float32"])
    report = capsys.readouterr().out
    assert code == 0, report
    rows = dict(line.strip("|").split("|")[:2] for line in report.splitlines() if line.startswith("| ") and "---" not in line)
    rows = {name.strip(): value.strip() for name, value in rows.items()}
    assert int(rows["requests"]) == 120
    assert int(rows["abandoned by the client"]) > 0 and int(rows["preemptions"]) > 0
    assert int(rows["429 answers (then retried)"]) > 0
