"""Fuzz qrun's model loaders with a larger corpus than CI runs (tests/model_file_fuzzer.py makes and
judges the cases; tests/test_model_file_fuzz.py runs a bounded one).

    python3 scripts/fuzz_model_files.py --cases 3000 --seed 1
    python3 scripts/fuzz_model_files.py --seed 1 --case 207     # one case again, with its mutation

Prints the counts: cases; loaded; clear errors (one line naming the file) and how many distinct
ones once paths, numbers and quoted names are blanked; unclear errors (a QrunError that is not);
crashes (any other exception, or the worker dying: an allocation failing under the worker's
address-space limit lands here); hangs (no answer within CASE_SECONDS). Then every failing case.
Exit status 1 when a case failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from model_file_fuzzer import CASE_SECONDS, KINDS, Watchdog, make_seeds, run_cases  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="cases to run, spread evenly over the file kinds")
    parser.add_argument("--seed", type=int, default=1, help="which corpus (case i of a seed is always the same)")
    parser.add_argument("--case", type=int, action="append", help="run only this case (repeatable)")
    parser.add_argument("--errors", action="store_true", help="also list the distinct clear errors")
    args = parser.parse_args()
    indices = args.case or list(range(args.cases))

    with tempfile.TemporaryDirectory(prefix="qrun-fuzz-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        seeds = make_seeds(root / "seeds", make_tiny_checkpoint(root / "seeds" / "llama", "llama"))
        (root / "cases").mkdir()
        with Watchdog(seeds.models()) as watchdog:
            def show(case, outcome):
                if args.case or outcome.verdict not in ("loaded", "clear error"):
                    print(f"case {case.index}: {case.mutation}\n  -> {outcome.verdict} in {outcome.seconds:.2f} s: "
                          f"{outcome.message}", flush=True)

            report = run_cases(seeds, args.seed, indices, root / "cases", watchdog, show)
        elapsed = time.perf_counter() - start

    counts = report.counts()
    distinct = report.distinct_errors()
    print(f"\nseed {args.seed}, kinds: {', '.join(KINDS)}")
    print(f"cases             {len(report.outcomes)}")
    print(f"loaded            {counts['loaded']}")
    print(f"clear errors      {counts['clear error']} ({len(distinct)} distinct)")
    print(f"unclear errors    {counts['unclear error']}")
    print(f"crashes           {counts['crash']}")
    print(f"hangs             {counts['hang']} (no answer within {CASE_SECONDS:.0f} s)")
    print(f"slowest case      {report.slowest():.2f} s; {elapsed:.0f} s in all")
    if args.errors:
        print("\ndistinct clear errors (count, normalized message):")
        for message, count in distinct.most_common():
            print(f"{count:6d}  {message}")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
