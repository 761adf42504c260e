"""An OpenAI-compatible HTTP server over one shared AsyncLLM.

Every HTTP request becomes one engine request per prompt, so concurrent clients are batched
continuously by the engine. Endpoints: /v1/models, /v1/completions, /v1/chat/completions
(streaming as server-sent events or not), /health and /metrics (Prometheus text format).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from qrun.async_llm import AsyncLLM
from qrun.errors import QrunError, RequestError
from qrun.options import add_engine_arguments, engine_args_from
from qrun.sampling_params import SamplingParams
from qrun.sequence import RequestOutput
from qrun.tokenizer import chat_messages

log = logging.getLogger("qrun.server")

DEFAULT_MAX_QUEUE = 256
# Seconds a client told "queue full" should wait; requests here last seconds, not minutes.
RETRY_AFTER_S = 1
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


# -- errors -----------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)=")


def _param_from_value_error(err: ValueError) -> str | None:
    """SamplingParams names the field it rejects; report it under the OpenAI field name."""
    match = _PARAM_IN_MESSAGE.search(str(err))
    if not match:
        return None
    name = match.group(1)
    return {"logprobs": "logprobs", "stop_strings": "stop"}.get(name, name)


# -- request field parsing --------------------------------------------------------------------
# Typed getters: a missing or null field takes the default; a wrong type is a 400 naming it.
def _number(body: dict, name: str, default: float | None, low: float | None = None,
            high: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(name, f"must be in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int | None = None,
             high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(name, f"must be an integer in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


def _stop(body: dict) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "must be a non-empty string or a list of them")
    return stops


def sampling_params(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """SamplingParams from the OpenAI fields and qrun's extensions (top_k, min_p, ...)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0),
            n=_integer(body, "n", 1, 1, 16),
            stop=_stop(body),
            seed=_integer(body, "seed", None),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            logprobs=logprobs,
            top_k=_integer(body, "top_k", -1),
            min_p=_number(body, "min_p", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            min_tokens=_integer(body, "min_tokens", 0),
            ignore_eos=_boolean(body, "ignore_eos", False),
        )
    except ValueError as err:
        param = _param_from_value_error(err)
        raise ApiError(400, str(err), param) from None


def _max_tokens(body: dict) -> int | None:
    # max_completion_tokens is the newer chat name of the same limit.
    newer = _integer(body, "max_completion_tokens", None, 1)
    return newer if newer is not None else _integer(body, "max_tokens", None, 1)


def _prompts(body: dict) -> list[str | list[int]]:
    """A completions prompt: text, token ids, or a batch of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return list(prompt)
    raise _bad("prompt", "must be a string, a list of strings, a list of token ids, or a list of those")


# -- metrics ----------------------------------------------------------------------------------
@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts):
            lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        lines += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.total}",
                  f"{name}_count {self.count}"]
        return lines


@dataclass
class ServerMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    requests_by_status: dict[int, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def render(self, stats: dict[str, float], in_flight: int) -> str:
        def gauge(name: str, value: float, help_text: str, kind: str = "gauge") -> list[str]:
            return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]

        lines = [
            *gauge("qrun_requests_running", stats.get("running", 0), "Sequences the engine is running."),
            *gauge("qrun_requests_waiting", stats.get("waiting", 0), "Sequences waiting for a slot or blocks."),
            *gauge("qrun_http_requests_in_flight", in_flight, "Generation requests the server holds."),
            *gauge("qrun_kv_blocks_used", stats.get("kv_blocks_used", 0), "KV cache blocks in use."),
            *gauge("qrun_kv_blocks_free", stats.get("kv_blocks_free", 0), "KV cache blocks free."),
            *gauge("qrun_kv_blocks_total", stats.get("kv_blocks_total", 0), "KV cache blocks in all."),
            *gauge("qrun_kv_blocks_cached", stats.get("kv_blocks_cached", 0),
                   "Free blocks still holding a reusable prefix."),
            *gauge("qrun_prefix_cache_hit_rate", stats.get("prefix_hit_rate", 0.0),
                   "Share of prompt blocks served from the prefix cache."),
            *gauge("qrun_preemptions_total", stats.get("num_preemptions", 0), "Sequences preempted.", "counter"),
            *gauge("qrun_generation_tokens_total", stats.get("generated_tokens", 0),
                   "Tokens the engine generated.", "counter"),
            *gauge("qrun_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests.",
                   "counter"),
            "# HELP qrun_http_requests_total Generation requests answered, by HTTP status.",
            "# TYPE qrun_http_requests_total counter",
            *(f'qrun_http_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests_by_status.items())),
            *self.ttft.render("qrun_time_to_first_token_seconds", "Arrival to first token."),
            *self.tpot.render("qrun_time_per_output_token_seconds", "Mean gap between output tokens, per request."),
            *self.latency.render("qrun_e2e_request_latency_seconds", "Arrival to the last token."),
        ]
        return "\n".join(lines) + "\n"


# -- one HTTP request's generation ------------------------------------------------------------
@dataclass
class Job:
    """What an endpoint asks of the engine: one engine request per prompt, n choices each."""

    request_id: str
    prompts: list[str | list[int]]
    params: SamplingParams
    started: float = field(default_factory=time.time)
    first_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def merged_outputs(llm: AsyncLLM, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from all of a job's engine requests as they arrive.

    Leaving early (client gone) cancels the per-prompt tasks, whose generators then abort
    their engine requests and free the blocks.
    """
    if len(job.prompts) == 1:  # the common case, without tasks in between
        async with contextlib.aclosing(llm.generate(job.prompts[0], job.params, job.request_id)) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prompt: str | list[int]) -> None:
        try:
            async with contextlib.aclosing(llm.generate(prompt, job.params, f"{job.request_id}-{index}")) as stream:
                async for output in stream:
                    queue.put_nowait((index, output))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, who re-raises it
            queue.put_nowait((index, err))
            if isinstance(err, asyncio.CancelledError):
                raise
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(job.prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _token_text(llm: AsyncLLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class ChoiceState:
    """What has been sent of one choice, so each chunk carries only the new part."""

    text_sent: int = 0
    logprobs_sent: int = 0
    finished: bool = False

    def advance(self, choice) -> tuple[str, list] | None:
        """The text and logprobs `choice` (a CompletionOutput) added since the last chunk, now
        counted as sent; None once its finishing chunk has gone, or when it added nothing."""
        if self.finished:
            return None
        text = choice.text[self.text_sent:]
        new_logprobs = (choice.logprobs or [])[self.logprobs_sent:]
        self.text_sent, self.logprobs_sent = len(choice.text), len(choice.logprobs or [])
        self.finished = choice.finish_reason is not None
        return (text, new_logprobs) if text or self.finished else None


class Server:
    def __init__(self, llm: AsyncLLM, api_key: str | None, max_queue: int, model_name: str):
        self.llm = llm
        self.api_key = api_key
        self.max_queue = max_queue
        self.model_name = model_name
        self.slots = llm.engine.config.max_num_seqs
        self.in_flight = 0
        self.metrics = ServerMetrics()
        self.created = int(time.time())

    # -- admission --------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.api_key}":
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           kind="authentication_error")

    def admit(self) -> None:
        """Requests beyond the engine's sequence slots queue; past max_queue of those, 429."""
        if self.in_flight >= self.slots + self.max_queue:
            raise ApiError(429, f"the server queue is full ({self.max_queue} waiting requests); retry later",
                           kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    # -- bookkeeping ------------------------------------------------------------------------
    def observe(self, job: Job, output: RequestOutput) -> None:
        if job.first_token is None and any(o.token_ids for o in output.outputs):
            job.first_token = time.time()
            self.metrics.ttft.observe(job.first_token - job.started)

    def finish(self, job: Job, status: int, outputs: dict[int, RequestOutput]) -> None:
        job.prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs.values())
        job.completion_tokens = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
        duration = time.time() - job.started
        metrics = self.metrics
        metrics.requests_by_status[status] = metrics.requests_by_status.get(status, 0) + 1
        if status == 200:
            metrics.prompt_tokens += job.prompt_tokens
            metrics.completion_tokens += job.completion_tokens
            metrics.latency.observe(duration)
            per_choice = job.completion_tokens / max(1, job.params.n * len(job.prompts))
            if job.first_token is not None and per_choice > 1:
                metrics.tpot.observe((time.time() - job.first_token) / (per_choice - 1))
        ttft = f"{job.first_token - job.started:.3f}s" if job.first_token else "-"
        log.info("%s status=%d prompt_tokens=%d completion_tokens=%d ttft=%s duration=%.3fs",
                 job.request_id, status, job.prompt_tokens, job.completion_tokens, ttft, duration)

    # -- running a job ----------------------------------------------------------------------
    async def first_output(self, job: Job) -> tuple[AsyncIterator[tuple[int, RequestOutput]], tuple[int, RequestOutput]]:
        """Start the job and wait for its first output, so a bad request is a 400, not a broken stream."""
        stream = merged_outputs(self.llm, job)
        try:
            first = await anext(stream)
        except (RequestError, ValueError) as err:
            await stream.aclose()
            raise ApiError(400, str(err), _param_from_value_error(err) if isinstance(err, ValueError)
                           and not isinstance(err, RequestError) else None) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream, first

    async def run(self, request: Request, job: Job, render: Callable[..., Any], stream: bool,
                  include_usage: bool) -> Response:
        self.admit()
        self.in_flight += 1
        try:
            outputs_stream, first = await self.first_output(job)
        except ApiError as err:
            self.in_flight -= 1
            self.finish(job, err.status, {})
            raise
        except BaseException:
            self.in_flight -= 1
            self.finish(job, 500, {})
            raise
        if stream:
            return StreamingResponse(self.sse(job, outputs_stream, first, render, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
        return await self.collect(request, job, outputs_stream, first, render)

    async def collect(self, request: Request, job: Job, stream: AsyncIterator, first: tuple[int, RequestOutput],
                      render: Callable[..., Any]) -> Response:
        """Run to completion; a client that leaves meanwhile cancels the work."""
        latest: dict[int, RequestOutput] = {}
        status = 500

        async def consume() -> None:
            index, output = first
            while True:
                self.observe(job, output)
                latest[index] = output
                try:
                    index, output = await anext(stream)
                except StopAsyncIteration:
                    return

        work = asyncio.create_task(consume())
        gone = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                status = 499  # nginx's "client closed request": nobody reads this answer
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return Response(status_code=499)
            work.result()
            status = 200
            return JSONResponse(render(job, latest))
        finally:
            # Bookkeeping first: under cancellation the awaits below may not get to run.
            self.in_flight -= 1
            self.finish(job, status, latest)
            gone.cancel()
            await stream.aclose()

    async def sse(self, job: Job, stream: AsyncIterator, first: tuple[int, RequestOutput],
                  render: Callable[..., Any], include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new piece of text, then usage, then [DONE].

        When the client disconnects, Starlette cancels this generator (or closes it at the
        next send); the finally clause then closes the engine stream, which aborts the requests.
        """
        states: dict[tuple[int, int], ChoiceState] = {}
        latest: dict[int, RequestOutput] = {}
        status = 499
        try:
            for chunk in render.first_chunks(job):
                yield _sse(chunk)
            index, output = first
            while True:
                self.observe(job, output)
                latest[index] = output
                for chunk in render.delta_chunks(job, index, output, states):
                    yield _sse(chunk)
                try:
                    index, output = await anext(stream)
                except StopAsyncIteration:
                    break
            if include_usage:
                yield _sse(render.usage_chunk(job, _usage(latest)))
            yield "data: [DONE]\n\n"
            status = 200
        except Exception as err:  # noqa: BLE001 - a failed engine step, reported to this client only
            # Headers are out: report the failure in-band, as OpenAI does.
            status = 500
            yield _sse(ApiError(500, str(err), kind="server_error").body())
            yield "data: [DONE]\n\n"
        finally:
            # Bookkeeping first: under cancellation the await below may not get to run (the
            # engine stream aborts its requests on its own when it is cancelled).
            self.in_flight -= 1
            self.finish(job, status, latest)
            await stream.aclose()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(outputs: dict[int, RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(reason: str | None) -> str | None:
    return FINISH_REASONS.get(reason, reason) if reason else None


# -- response shapes --------------------------------------------------------------------------
class CompletionRender:
    """Bodies of /v1/completions: choices[i].text, logprobs in the legacy shape."""

    def __init__(self, server: Server, echo: bool):
        self.server, self.echo = server, echo

    def _logprobs(self, entries: list[dict[int, float]] | None, k: int | None) -> dict | None:
        if entries is None:
            return None
        llm = self.server.llm
        tokens, values, tops = [], [], []
        for entry in entries:
            token_id, value = next(iter(entry.items()))  # the sampled token comes first
            tokens.append(_token_text(llm, token_id))
            values.append(value)
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:k or 0]
            tops.append({_token_text(llm, t): v for t, v in best} if k else None)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": []}

    def _base(self, job: Job) -> dict:
        return {"id": job.request_id, "object": "text_completion", "created": int(job.started),
                "model": self.server.model_name}

    def __call__(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        choices = []
        for index, output in sorted(outputs.items()):
            for c in output.outputs:
                prefix = output.prompt if self.echo and output.prompt else ""
                choices.append({"index": index * job.params.n + c.index, "text": prefix + c.text,
                                "logprobs": self._logprobs(c.logprobs, job.params.logprobs),
                                "finish_reason": _finish_reason(c.finish_reason)})
        return {**self._base(job), "choices": choices, "usage": _usage(outputs)}

    def first_chunks(self, job: Job) -> list[dict]:
        return []

    def delta_chunks(self, job: Job, index: int, output: RequestOutput,
                     states: dict[tuple[int, int], ChoiceState]) -> list[dict]:
        chunks = []
        for c in output.outputs:
            state = states.setdefault((index, c.index), ChoiceState())
            first = state.text_sent == 0
            if (sent := state.advance(c)) is None:
                continue
            text, new_logprobs = sent
            if first and self.echo and output.prompt:
                text = output.prompt + text
            chunks.append({**self._base(job), "choices": [{
                "index": index * job.params.n + c.index, "text": text,
                "logprobs": self._logprobs(new_logprobs, job.params.logprobs) if c.logprobs is not None else None,
                "finish_reason": _finish_reason(c.finish_reason)}]})
        return chunks

    def usage_chunk(self, job: Job, usage: dict) -> dict:
        return {**self._base(job), "choices": [], "usage": usage}


class ChatRender:
    """Bodies of /v1/chat/completions: an assistant message, logprobs in the content shape."""

    def __init__(self, server: Server, top_logprobs: int):
        self.server, self.top_logprobs = server, top_logprobs

    def _logprobs(self, entries: list[dict[int, float]] | None) -> dict | None:
        if entries is None:
            return None
        llm = self.server.llm

        def item(token_id: int, value: float) -> dict:
            text = _token_text(llm, token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        content = []
        for entry in entries:
            token_id, value = next(iter(entry.items()))
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            content.append({**item(token_id, value), "top_logprobs": [item(t, v) for t, v in best]})
        return {"content": content}

    def _base(self, job: Job, obj: str) -> dict:
        return {"id": job.request_id, "object": obj, "created": int(job.started), "model": self.server.model_name}

    def __call__(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        output = outputs[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.logprobs), "finish_reason": _finish_reason(c.finish_reason)}
                   for c in output.outputs]
        return {**self._base(job, "chat.completion"), "choices": choices, "usage": _usage(outputs)}

    def first_chunks(self, job: Job) -> list[dict]:
        # OpenAI opens each choice with its role and empty content.
        return [{**self._base(job, "chat.completion.chunk"), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
            for i in range(job.params.n)]

    def delta_chunks(self, job: Job, index: int, output: RequestOutput,
                     states: dict[tuple[int, int], ChoiceState]) -> list[dict]:
        chunks = []
        for c in output.outputs:
            if (sent := states.setdefault((index, c.index), ChoiceState()).advance(c)) is None:
                continue
            text, new_logprobs = sent
            chunks.append({**self._base(job, "chat.completion.chunk"), "choices": [{
                "index": c.index, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(new_logprobs) if c.logprobs is not None else None,
                "finish_reason": _finish_reason(c.finish_reason)}]})
        return chunks

    def usage_chunk(self, job: Job, usage: dict) -> dict:
        return {**self._base(job, "chat.completion.chunk"), "choices": [], "usage": usage}


# -- the app ----------------------------------------------------------------------------------
def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    return _boolean(options, "include_usage", False)


def _check_common(body: dict) -> None:
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "must be a string")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "must be a string")


def build_app(llm: AsyncLLM, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
              model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving `llm`. `max_queue`: requests allowed to wait for an engine slot."""
    server = Server(llm, api_key, max_queue, model_name or str(llm.engine.config.model))
    app = FastAPI(title="qrun", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    async def json_body(request: Request) -> dict:
        server.check_auth(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        _check_common(body)
        return body

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(llm.stats(), server.in_flight),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        server.check_auth(request)
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "qrun",
            "max_model_len": llm.engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await json_body(request)
        prompts = _prompts(body)
        logprobs = _integer(body, "logprobs", None, 0, 20)
        params = sampling_params(body, _max_tokens(body) or 16, logprobs)  # OpenAI's default: 16
        stream = _boolean(body, "stream", False)
        job = Job(f"cmpl-{uuid.uuid4().hex}", prompts, params)
        render = CompletionRender(server, _boolean(body, "echo", False))
        return await server.run(request, job, render, stream, stream and _include_usage(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await json_body(request)
        try:
            prompt_ids = llm.tokenizer.encode_chat(chat_messages(body.get("messages")))
        except ValueError as err:
            field, _, problem = str(err).partition(": ")
            raise _bad(field, problem) from None
        except QrunError as err:
            raise _bad("messages", str(err)) from None
        top_logprobs = _integer(body, "top_logprobs", 0, 0, 20)
        logprobs = top_logprobs if _boolean(body, "logprobs", False) else None
        max_tokens = _max_tokens(body)
        if max_tokens is None:  # OpenAI's chat default: whatever the context (or the KV cache) leaves
            max_tokens = max(1, llm.engine.request_token_limit - len(prompt_ids))
        params = sampling_params(body, max_tokens, logprobs)
        stream = _boolean(body, "stream", False)
        job = Job(f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids], params)
        return await server.run(request, job, ChatRender(server, top_logprobs), stream,
                                stream and _include_usage(body))

    return app


# -- the command line -------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder, .gguf file, alias or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help="requests that may wait for an engine slot before new ones get 429")
    parser.add_argument("--served-model-name", default=None, help="model id reported by the API")
    add_engine_arguments(parser)
    parser.add_argument("--log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queue < 0:
        raise QrunError(f"--max-queue={args.max_queue} must be >= 0")
    llm = AsyncLLM(args.model, **engine_args_from(args))
    try:
        app = build_app(llm, api_key=args.api_key, max_queue=args.max_queue,
                        model_name=args.served_model_name or str(args.model))
        # Our own per-request log line replaces uvicorn's access log.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qrun serve", description=__doc__)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
