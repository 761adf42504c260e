#!/usr/bin/env python
"""Soak `qrun serve`: many mixed requests, some clients walking away, then check nothing leaked.

Starts `qrun serve MODEL` on a free loopback port with a small KV cache (so sequences are
preempted) and a short queue (so some requests get 429), then `--concurrency` clients send
`--requests` requests drawn from a seeded mix: completions and chat, streamed or not, n up to 4,
stop strings, JSON-constrained outputs, prompts sharing long prefixes; about `--abandon` of the
clients disconnect at a random point mid-stream or time out, and a request turned away with 429
is sent again with backoff. At the end it checks:

- every request had exactly one outcome: complete, error (with its status) or abandoned;
- the engine returns to idle: no sequence running or waiting, every KV block free, no block
  referenced (the prefix cache's reference counts are zero);
- the server's resident memory grew by less than `--max-rss-growth` between the 200th and the
  last request;
- /metrics agrees with the client: requests per HTTP status match (an abandoned request counts
  as 200 or 499, whichever the server saw first; every 429 counts).

    python scripts/soak.py smollm2-135m --requests 1000
    python scripts/soak.py smollm2-135m --requests 200 -- --kv-cache-dtype int8

Loopback only; exit code 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil
from load_test import NO_PROXY, open_request, start_server

from qrun.bench import percentile
from qrun.server.app import RETRY_AFTER_S

DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "workloads" / "mixed_lengths.jsonl"
# A request that has not finished by then is stuck: the soak fails it as a hang.
HANG_S = 600.0
MAX_ATTEMPTS = 6
RSS_BASELINE_REQUEST = 200
SYSTEM_PROMPTS = [  # shared prefixes, so the prefix cache has blocks to share and to release
    "You are a careful assistant. Answer in one or two sentences, plainly, without lists.",
    "You are a librarian who summarises books. Keep every answer short and name the main character.",
    "You translate ideas into plain English for children. Use short words. Never use more than 40 words.",
]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
                 "required": ["answer", "confidence"]}


@dataclass
class Plan:
    """One request of the soak, and how its client behaves."""

    index: int
    path: str
    body: dict
    disconnect_after: int | None = None  # server-sent events read before hanging up (streams), or 0
    timeout: float | None = None  # seconds before the client gives up


@dataclass
class Outcome:
    index: int
    kind: str  # "complete", "error" or "abandoned"
    status: int | None  # the HTTP status the client saw; None when it left before one came
    latency: float
    completion_tokens: int = 0
    detail: str = ""
    rejections: int = 0  # 429 answers before this outcome


def plan_requests(count: int, prompts: list[str], abandon: float, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(count):
        text = rng.choice(prompts)
        stream = rng.random() < 0.5
        body: dict = {"model": "soak", "max_tokens": rng.randint(4, 32), "temperature": rng.choice([0, 0.7, 1.0]),
                      "seed": i, "stream": stream, "n": rng.choice([1, 1, 1, 2, 4])}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            body["stop"] = rng.sample(["\n\n", ".", " the ", "!", "?"], rng.randint(1, 3))
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                                {"role": "user", "content": text}]
            if rng.random() < 0.15:
                body["response_format"] = rng.choice([
                    {"type": "json_object"},
                    {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}])
        else:
            path = "/v1/completions"
            body["prompt"] = rng.choice(SYSTEM_PROMPTS) + "\n\n" + text
        plan = Plan(i, path, body)
        if rng.random() < abandon:
            if stream and rng.random() < 0.5:
                plan.disconnect_after = rng.randint(0, 8)
            else:
                plan.timeout = rng.uniform(0.05, 3.0)
        plans.append(plan)
    return plans


async def run_request(host: str, port: int, plan: Plan) -> Outcome:
    """The request's one outcome. Turned away with 429, it is sent again after Retry-After,
    doubling the wait each time (OpenAI's clients back off alike), up to MAX_ATTEMPTS."""
    start = time.perf_counter()
    rejections = 0
    while (outcome := await attempt(host, port, plan, start)).status == 429 and rejections < MAX_ATTEMPTS - 1:
        await asyncio.sleep(RETRY_AFTER_S * 2 ** rejections)
        rejections += 1
    outcome.rejections = rejections
    return outcome


async def attempt(host: str, port: int, plan: Plan, start: float) -> Outcome:
    def outcome(kind: str, status: int | None, tokens: int = 0, detail: str = "") -> Outcome:
        return Outcome(plan.index, kind, status, time.perf_counter() - start, tokens, detail)

    reply = None
    try:
        async with asyncio.timeout(plan.timeout or HANG_S):
            reply = await open_request(host, port, plan.path, plan.body, None)
            if reply.status != 200:
                error = (await reply.json()).get("error", {})
                return outcome("error", reply.status, detail=error.get("message", ""))
            if not plan.body["stream"]:
                return outcome("complete", 200, (await reply.json())["usage"]["completion_tokens"])
            events, tokens = 0, 0
            async for event in reply.events():
                if "error" in event:
                    return outcome("error", 200, detail=event["error"].get("message", ""))
                events += 1
                if plan.disconnect_after is not None and events > plan.disconnect_after:
                    return outcome("abandoned", 200, detail="disconnected mid-stream")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            return outcome("complete", 200, tokens)
    except TimeoutError:
        if plan.timeout is None:
            return outcome("error", None, detail=f"no answer within {HANG_S:.0f}s: a hang")
        return outcome("abandoned", reply.status if reply else None, detail="timed out")
    except (OSError, ValueError, KeyError) as err:
        return outcome("error", None, detail=f"{type(err).__name__}: {err}")
    finally:
        if reply is not None:
            reply.close()


def read_metrics(url: str) -> dict[str, float]:
    with NO_PROXY.open(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(qrun_[\w{}=\"]+) (\S+)$", text, re.M)}


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        metrics = read_metrics(url)
        busy = {name: metrics[name] for name in ("qrun_requests_running", "qrun_requests_waiting",
                                                         "qrun_http_requests_in_flight", "qrun_kv_blocks_used",
                                                         "qrun_kv_block_references")}
        if not any(busy.values()) or time.time() > deadline:
            return metrics
        time.sleep(0.2)


async def soak(url: str, plans: list[Plan], concurrency: int, server_pid: int) -> tuple[list[Outcome], dict]:
    host, port = url.removeprefix("http://").split(":")
    pending = iter(plans)
    outcomes: list[Outcome] = []
    rss = {}
    process = psutil.Process(server_pid)

    async def client() -> None:
        for plan in pending:
            outcomes.append(await run_request(host, int(port), plan))
            if len(outcomes) % 100 == 0:
                print(f"{len(outcomes)} requests done", file=sys.stderr)
            if len(outcomes) == min(RSS_BASELINE_REQUEST, len(plans)):
                rss["baseline"] = process.memory_info().rss

    await asyncio.gather(*(client() for _ in range(concurrency)))
    rss["end"] = process.memory_info().rss
    return outcomes, rss


def check(outcomes: list[Outcome], plans: list[Plan], metrics: dict[str, float], rss: dict,
          max_rss_growth: float) -> list[str]:
    """The soak's failures, each one line; empty when it held."""
    failures = []
    indices = Counter(o.index for o in outcomes)
    if sorted(indices) != [p.index for p in plans] or max(indices.values()) != 1:
        failures.append("not every request had exactly one outcome")
    for outcome in outcomes:
        if outcome.kind == "error" and (outcome.status is None or outcome.status >= 500 or outcome.status == 200):
            failures.append(f"request {outcome.index}: {outcome.status} {outcome.detail}")
    for name in ("qrun_requests_running", "qrun_requests_waiting", "qrun_http_requests_in_flight",
                 "qrun_kv_blocks_used", "qrun_kv_block_references"):
        if metrics[name] != 0:
            failures.append(f"after the soak {name} = {metrics[name]}, not 0")
    served = {int(m.group(1)): int(v) for k, v in metrics.items() if (m := re.match(r'qrun_http_requests_total\{status="(\d+)"\}', k))}
    seen = Counter(o.status for o in outcomes if o.kind != "abandoned")
    seen[429] += sum(o.rejections for o in outcomes)
    for status in sorted(set(served) | set(seen)):
        if status not in (200, 499) and served.get(status, 0) != seen.get(status, 0):
            failures.append(f"/metrics counts {served.get(status, 0)} answers {status}, the clients {seen.get(status, 0)}")
    abandoned = sum(o.kind == "abandoned" for o in outcomes)
    if served.get(200, 0) + served.get(499, 0) != seen.get(200, 0) + abandoned or served.get(200, 0) < seen.get(200, 0):
        failures.append(f"/metrics counts {served.get(200, 0)} answers 200 and {served.get(499, 0)} 499; the clients "
                        f"completed {seen.get(200, 0)} and abandoned {abandoned}")
    growth = rss["end"] / rss["baseline"] - 1
    if growth > max_rss_growth:
        failures.append(f"resident memory grew {growth:.1%} from request {RSS_BASELINE_REQUEST} to the end")
    return failures


def print_table(outcomes: list[Outcome], metrics: dict[str, float], rss: dict, elapsed: float) -> None:
    kinds = Counter(o.kind for o in outcomes)
    statuses = Counter(o.status for o in outcomes if o.kind == "error")
    latency = [o.latency for o in outcomes if o.kind == "complete"]
    rows = [
        ("requests", len(outcomes)),
        ("complete", kinds["complete"]),
        ("error", f"{kinds['error']} ({', '.join(f'{s}: {n}' for s, n in sorted(statuses.items(), key=str))})"),
        ("abandoned by the client", kinds["abandoned"]),
        ("429 answers (then retried)", sum(o.rejections for o in outcomes)),
        ("preemptions", int(metrics.get("qrun_preemptions_total", 0))),
        ("generated tokens (server)", int(metrics.get("qrun_generation_tokens_total", 0))),
        ("latency p50 / p99 s (complete)", f"{percentile(latency, 50):.2f} / {percentile(latency, 99):.2f}"),
        ("RSS at request 200 / end MiB", f"{rss['baseline'] / 2**20:.0f} / {rss['end'] / 2**20:.0f}"),
        ("wall time s", f"{elapsed:.0f}"),
    ]
    print("| | |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="what `qrun serve` serves")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=24, help="clients sending at once")
    parser.add_argument("--abandon", type=float, default=0.2, help="share of clients that disconnect or time out")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with a `prompt` per line")
    parser.add_argument("--kv-cache-memory", default="24MiB", help="small, so that sequences are preempted")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=8, help="short, so that some requests get 429")
    parser.add_argument("--max-rss-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--server-log", default=None, help="file for the server's output")
    parser.epilog = "Flags after -- go to `qrun serve` (e.g. -- --kv-cache-dtype int8)."
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    server_args = argv[split + 1:]
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.abandon <= 1:
        parser.error("--requests and --concurrency must be >= 1 and --abandon within [0, 1]")
    args.model_name = "soak"
    args.server_args = server_args + [
        "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
        "--max-queue", str(args.max_queue)]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    plans = plan_requests(args.requests, prompts, args.abandon, args.seed)
    server, url = start_server(args)
    try:
        start = time.perf_counter()
        outcomes, rss = asyncio.run(soak(url, plans, args.concurrency, server.pid))
        elapsed = time.perf_counter() - start
        metrics = wait_idle(url, timeout=60)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print_table(outcomes, metrics, rss, elapsed)
    failures = check(outcomes, plans, metrics, rss, args.max_rss_growth)
    for failure in failures:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
