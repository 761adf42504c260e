#!/usr/bin/env python
"""Load-test a qrun (or any OpenAI-compatible) server on this machine.

At each concurrency level, that many clients send streaming /v1/completions requests back to
back until `--requests` are done or `--time-limit` seconds pass; the table reports requests/s,
output tokens/s, and time-to-first-token and end-to-end latency percentiles.

    python scripts/load_test.py --model smollm2-135m --concurrency 1,4,16 --requests 32
    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 1,8

Loopback only: the client refuses any other host, and a server it starts binds 127.0.0.1.
Only the standard library is used on the client side, so its overhead is small and known.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from qrun.bench import percentile

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Never route loopback requests through an HTTP proxy from the environment.
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
WORDS = "the quick brown fox jumps over the lazy dog while a small model writes a story".split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    completion_tokens: int = 0
    error: str = ""


def make_prompt(i: int, words: int) -> str:
    # Distinct per request so the prefix cache does not turn the test into a cache benchmark.
    return f"[{i}] " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


@dataclass
class HttpReply:
    """A request's status line and headers read; the body still on `reader`."""

    status: int
    chunked: bool
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def body(self):
        """The body's bytes as they arrive."""
        if not self.chunked:
            while data := await self.reader.read(65536):
                yield data
            return
        while True:
            size = int((await self.reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            yield await self.reader.readexactly(size)
            await self.reader.readline()  # the CRLF after each chunk

    async def events(self):
        """The parsed JSON of each server-sent event, up to `data: [DONE]`."""
        buffer = b""
        async for data in self.body():
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if event == b"data: [DONE]":
                    return
                if event.startswith(b"data: "):
                    yield json.loads(event[6:])

    async def json(self) -> dict:
        return json.loads(b"".join([data async for data in self.body()]))

    def close(self) -> None:
        self.writer.close()


async def open_request(host: str, port: int, path: str, body: dict, api_key: str | None) -> HttpReply:
    """POST `body` over a raw HTTP/1.1 connection and read up to the end of the headers."""
    payload = json.dumps(body).encode()
    headers = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
               f"Content-Length: {len(payload)}", "Connection: close"]
    if api_key:
        headers.append(f"Authorization: Bearer {api_key}")
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
    except BaseException:
        writer.close()
        raise
    return HttpReply(status, chunked, reader, writer)


async def stream_completion(host: str, port: int, body: dict, api_key: str | None) -> Result:
    """POST one streaming completion; time its first and last token."""
    start = time.perf_counter()
    reply = None
    try:
        reply = await open_request(host, port, "/v1/completions", body, api_key)
        if reply.status != 200:
            return Result(False, error=f"HTTP {reply.status}")
        ttft, tokens = None, 0
        async for chunk in reply.events():
            if "error" in chunk:
                return Result(False, error=chunk["error"].get("message", "error"))
            if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        latency = time.perf_counter() - start
        return Result(True, ttft if ttft is not None else latency, latency, tokens)
    except (OSError, ValueError, IndexError) as err:
        return Result(False, error=f"{type(err).__name__}: {err}")
    finally:
        if reply is not None:
            reply.close()


async def run_level(host: str, port: int, concurrency: int, args: argparse.Namespace) -> tuple[list[Result], float]:
    """`concurrency` clients share a budget of `args.requests` requests and `args.time_limit` seconds."""
    counter = iter(range(args.requests))
    deadline = time.perf_counter() + args.time_limit
    results: list[Result] = []

    async def worker() -> None:
        for i in counter:
            if time.perf_counter() > deadline:
                return
            body = {"model": args.model_name, "prompt": make_prompt(i, args.prompt_words),
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            results.append(await stream_completion(host, port, body, args.api_key))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def report_row(concurrency: int, results: list[Result], elapsed: float) -> dict:
    good = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in good]
    latency = [r.latency * 1000 for r in good]
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(good),
        "req/s": len(good) / elapsed, "out tok/s": sum(r.completion_tokens for r in good) / elapsed,
        "ttft p50": percentile(ttft, 50), "ttft p90": percentile(ttft, 90), "ttft p99": percentile(ttft, 99),
        "lat p50": percentile(latency, 50), "lat p90": percentile(latency, 90), "lat p99": percentile(latency, 99),
        "first error": next((r.error for r in results if not r.ok), ""),
    }


def print_table(rows: list[dict]) -> None:
    columns = ["concurrency", "requests", "errors", "req/s", "out tok/s",
               "ttft p50", "ttft p90", "ttft p99", "lat p50", "lat p90", "lat p99"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---:" for _ in columns) + "|")
    for row in rows:
        cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + " |")
    print("(times in ms; TTFT and latency measured at the client, over successful requests)")
    for row in rows:
        if row["first error"]:
            print(f"concurrency {row['concurrency']}: first error: {row['first error']}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start `qrun serve` on a free loopback port; return it once /health answers."""
    port = _free_port()
    command = [sys.executable, "-m", "qrun.server", args.model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", args.model_name, "--max-queue", "4096", "--log-level", "warning",
               *args.server_args]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.startup_timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}; see --server-log")
        try:
            with NO_PROXY.open(url + "/health", timeout=1):
                return server, url
        except OSError:
            time.sleep(0.25)
    server.terminate()
    raise SystemExit(f"the server did not answer /health within {args.startup_timeout}s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="start `qrun serve MODEL` on a free loopback port for the test")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level (at most)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per level (at most)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--model-name", default="qrun", help="the `model` field sent")
    parser.add_argument("--api-key", default=os.environ.get("QRUN_API_KEY"))
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--server-log", default=None, help="file for the started server's output")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests before the first level")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="after --: extra `qrun serve` flags for a started server (e.g. -- --device cpu)")
    args = parser.parse_args(argv)
    args.server_args = [a for a in args.server_args if a != "--"]
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.requests < 1 or args.time_limit <= 0 or not args.levels or min(args.levels) < 1:
        parser.error("--requests, --time-limit and every --concurrency level must be positive")
    return args


async def run_all(url: str, args: argparse.Namespace) -> list[dict]:
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK:
        raise SystemExit(f"refusing {url}: this load test only talks to servers on this machine (127.0.0.1)")
    host, port = parts.hostname, parts.port or 80
    for i in range(args.warmup):  # first requests pay one-off costs (allocations, kernel choices)
        await stream_completion(host, port, {"model": args.model_name, "prompt": make_prompt(-1 - i, 4),
                                             "max_tokens": 4, "stream": True}, args.api_key)
    rows = []
    for level in args.levels:
        results, elapsed = await run_level(host, port, level, args)
        rows.append(report_row(level, results, elapsed))
        print(f"concurrency {level}: {len(results)} requests in {elapsed:.1f}s", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    url = args.url
    if args.model:
        server, url = start_server(args)
    try:
        rows = asyncio.run(run_all(url, args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print_table(rows)
    return 0 if all(row["errors"] == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
