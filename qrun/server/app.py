"""The HTTP app: `Server` (API key, admission, running a job to an answer or a stream) and the
routes of `build_app`."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from qrun.async_llm import AsyncLLM
from qrun.errors import EngineStopped, QrunError, RequestError, RequestFailed
from qrun.sequence import RequestOutput
from qrun.server.job import Job, PromptOutput, merged_outputs
from qrun.server.metrics import ServerMetrics
from qrun.server.protocol import (MAX_BODY_BYTES, NOT_JSON, ApiError, ChatCompletionRequest, CompletionRequest,
                                  ErrorResponse, invalid_request)
from qrun.server.render import STREAM_END, ChatRender, CompletionRender, Render, sse_event, usage
from qrun.server.tools import ToolCalling
from qrun.tokenizer import chat_messages

log = logging.getLogger("qrun.server")

DEFAULT_MAX_QUEUE = 256
# Seconds a client told "queue full" should wait; requests here last seconds, not minutes.
RETRY_AFTER_S = 1


class BodyLimit:
    """ASGI middleware answering 413 to a body over `limit` bytes, by its Content-Length or, sent
    in chunks, as soon as the chunks pass it: the app never holds more than the limit."""

    def __init__(self, app: Callable, limit: int):
        self.app, self.limit = app, limit
        self.message = f"the request body is larger than the server's limit of {limit} bytes"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._discard_body(receive)
            return await ApiError(413, self.message).response()(scope, receive, send)
        received = 0

        async def receive_within_limit() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                if message.get("more_body"):
                    await self._discard_body(receive)
                raise StarletteHTTPException(413, self.message)  # answered by the app's handler
            return message

        await self.app(scope, receive_within_limit, send)

    @staticmethod
    async def _discard_body(receive: Callable) -> None:
        # Read to the end, keeping nothing: a client still sending when the answer comes would
        # see its connection reset instead of the 413.
        while (await receive()).get("more_body", False):
            pass


class Server:
    """What every HTTP request shares: the engine, who may use it, how many may wait for it, and
    the metrics; `run` takes one job to a JSON answer or an event stream."""

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
    def auth_error(self, request: Request) -> ApiError | None:
        # Compared in constant time, so response times do not reveal how much of a guess was right.
        given = request.headers.get("authorization", "").encode()
        if self.api_key is None or hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            return None
        return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        kind="authentication_error")

    async def require_auth(self, request: Request) -> None:
        """The /v1 routes' dependency."""
        if (error := self.auth_error(request)) is not None:
            raise error

    def admit(self) -> None:
        """503 once the engine has stopped. Requests beyond the engine's sequence slots queue;
        past max_queue of those, 429."""
        if self.llm.stopped_reason is not None:
            raise ApiError(503, self.llm.stopped_reason, kind="server_error")
        if self.in_flight >= self.slots + self.max_queue:
            raise ApiError(429, f"the server queue is full ({self.max_queue} waiting requests); retry later",
                           kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    # -- bookkeeping ------------------------------------------------------------------------
    def finish(self, job: Job, status: int, outputs: dict[int, RequestOutput]) -> None:
        finished = time.time()
        counts = usage(outputs)
        job.prompt_tokens, job.completion_tokens = counts["prompt_tokens"], counts["completion_tokens"]
        self.metrics.record(job, status, finished)
        ttft = f"{job.first_token - job.started:.3f}s" if job.first_token else "-"
        log.info("%s status=%d prompt_tokens=%d completion_tokens=%d ttft=%s duration=%.3fs",
                 job.request_id, status, job.prompt_tokens, job.completion_tokens, ttft, finished - job.started)

    async def _tracked(self, job: Job, first: PromptOutput, rest: AsyncIterator[PromptOutput],
                       latest: dict[int, RequestOutput]) -> AsyncIterator[PromptOutput]:
        """`first`, then the rest of the job's outputs; each kept in `latest` (the newest per
        prompt, for usage and the answer) and the first token timed."""
        index, output = first
        while True:
            if job.first_token is None and any(o.token_ids for o in output.outputs):
                job.first_token = time.time()
                self.metrics.ttft.observe(job.first_token - job.started)
            latest[index] = output
            yield index, output
            try:
                index, output = await anext(rest)
            except StopAsyncIteration:
                return

    # -- running a job ----------------------------------------------------------------------
    async def first_output(self, job: Job) -> tuple[AsyncIterator[PromptOutput], PromptOutput]:
        """Start the job and wait for its first output, so a bad request is a 400, not a broken stream."""
        stream = merged_outputs(self.llm, job)
        try:
            first = await anext(stream)
        except RequestError as err:  # a prompt the engine can never serve (too long, empty)
            await stream.aclose()
            raise ApiError(400, str(err), getattr(err, "param", None)) from None
        except BaseException:
            await stream.aclose()
            raise
        return stream, first

    async def run(self, request: Request, job: Job, render: Render, stream: bool, include_usage: bool) -> Response:
        try:
            self.admit()
        except ApiError as error:  # turned away (429, 503): counted in /metrics as every answer is
            self.finish(job, error.status, {})
            raise
        self.in_flight += 1
        try:
            outputs_stream, first = await self.first_output(job)
        except Exception as err:  # noqa: BLE001 - every failure is answered in OpenAI's shape
            error = server_error(err)
            self.in_flight -= 1
            self.finish(job, error.status, {})
            raise error from None
        except BaseException:  # cancelled: the client left before the first token
            self.in_flight -= 1
            self.finish(job, 499, {})
            raise
        if stream:
            return StreamingResponse(self.events(job, outputs_stream, first, render, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": job.request_id})
        return await self.collect(request, job, outputs_stream, first, render)

    async def collect(self, request: Request, job: Job, stream: AsyncIterator[PromptOutput],
                      first: PromptOutput, render: Render) -> Response:
        """Run to completion; a client that leaves meanwhile cancels the work."""
        latest: dict[int, RequestOutput] = {}
        status = 500

        async def consume() -> None:
            async for _ in self._tracked(job, first, stream, latest):
                pass

        work = asyncio.create_task(consume())
        gone = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                status = 499  # nginx's "client closed request": nobody reads this answer
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return Response(status_code=499)
            if (failure := work.exception()) is not None:
                error = server_error(failure)
                status = error.status
                raise error from None
            status = 200
            return JSONResponse(render.answer(job, latest))
        finally:
            # Bookkeeping first: under cancellation the awaits below may not get to run.
            self.in_flight -= 1
            self.finish(job, status, latest)
            gone.cancel()
            await stream.aclose()

    async def events(self, job: Job, stream: AsyncIterator[PromptOutput], first: PromptOutput,
                     render: Render, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new piece of text, then usage, then [DONE].

        When the client disconnects, Starlette cancels this generator (or closes it at the
        next send); the finally clause then closes the engine stream, which aborts the requests.
        """
        latest: dict[int, RequestOutput] = {}
        status = 499
        try:
            for chunk in render.first_chunks(job):
                yield sse_event(chunk)
            async for index, output in self._tracked(job, first, stream, latest):
                for chunk in render.delta_chunks(job, index, output):
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event(render.usage_chunk(job, latest))
            yield STREAM_END
            status = 200
        except Exception as err:  # noqa: BLE001 - a failed request, reported to this client only
            # Headers are out: report the failure in-band, as OpenAI does.
            error = server_error(err)
            status = error.status
            yield sse_event(error.body())
            yield STREAM_END
        finally:
            # Bookkeeping first: under cancellation the await below may not get to run (the
            # engine stream aborts its requests on its own when it is cancelled).
            self.in_flight -= 1
            self.finish(job, status, latest)
            await stream.aclose()


def server_error(err: Exception) -> ApiError:
    """`err` as an answer in OpenAI's shape: a refusal stays as it is; a stopped engine is a 503;
    a request the engine failed, or anything else, a 500."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, EngineStopped):
        return ApiError(503, str(err), kind="server_error")
    if not isinstance(err, RequestFailed):  # logged by the engine; anything else may be a bug here
        log.error("request failed", exc_info=err)
    return ApiError(500, str(err) if isinstance(err, QrunError) else f"internal error ({type(err).__name__}: {err})",
                    kind="server_error")


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(llm: AsyncLLM, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
              model_name: str | None = None, cors_origins: list[str] | None = None) -> FastAPI:
    """The FastAPI app serving `llm`. `max_queue`: requests allowed to wait for an engine slot.
    `cors_origins`: web origins whose pages may call the API from a browser ("*": any); none
    by default, so browsers let no page read an answer."""
    server = Server(llm, api_key, max_queue, model_name or str(llm.engine.config.model))
    # strict_content_type=False: a body sent without a Content-Type is still read as JSON.
    app = FastAPI(title="qrun", docs_url=None, redoc_url=None, strict_content_type=False)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    if cors_origins:  # added last, so outermost: every answer (a 413 too) is readable by those pages
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    # FastAPI reads and validates the body before any dependency runs, so these answer a client
    # without the API key with 401 themselves, as a valid body would be answered.
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        return (server.auth_error(request) or invalid_request(err.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        if err.status_code == 400:  # FastAPI could not decode the body (not UTF-8, say)
            return (server.auth_error(request) or ApiError(400, NOT_JSON)).response()
        # the rest (routing's 404 and 405, BodyLimit's 413) in OpenAI's shape too: clients parse
        # every error alike
        message = str(err.detail)
        if err.status_code in (404, 405):
            message += f": {request.method} {request.url.path} (the endpoints are listed in /openapi.json)"
        return ApiError(err.status_code, message, headers=err.headers).response()

    @app.get("/health")
    async def health() -> Response:
        if llm.stopped_reason is not None:
            return ApiError(503, llm.stopped_reason, kind="server_error").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(server.metrics.render(llm.stats(), server.in_flight),
                                 media_type="text/plain; version=0.0.4")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.require_auth)], responses={"4XX": {
        "model": ErrorResponse, "description": "invalid request (400), wrong API key (401), queue full (429)"}})

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "qrun",
            "max_model_len": llm.engine.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        params = body.sampling_params(body.token_limit, body.logprobs)
        job = Job(f"cmpl-{uuid.uuid4().hex}", body.prompts(), params)
        render = CompletionRender(llm.tokenizer, server.model_name, body.echo)
        return await server.run(request, job, render, body.stream, body.include_usage)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        offered = body.model_dump(include={"tools", "tool_choice"})
        try:
            tools = ToolCalling.from_request(offered["tools"], offered["tool_choice"])
        except ValueError as err:
            raise ApiError(400, f"tool_choice: {err}", "tool_choice") from None
        messages = chat_messages([m.model_dump() for m in body.messages])
        if tools is not None and not llm.tokenizer.renders_tools:
            messages = [{"role": "system", "content": tools.instructions()}, *messages]
        try:
            prompt_ids = llm.tokenizer.encode_chat(messages, tools=None if tools is None else tools.template_tools())
        except QrunError as err:  # the model's chat template refused these messages
            raise ApiError(400, f"messages: {err}", "messages") from None
        max_tokens = body.token_limit
        if max_tokens is None:  # OpenAI's chat default: whatever the context (or the KV cache) leaves
            max_tokens = max(1, llm.engine.request_token_limit - len(prompt_ids))
        params = body.sampling_params(max_tokens, body.top_logprobs if body.logprobs else None,
                                      None if tools is None else tools.constraint())
        job = Job(f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids], params)
        render = ChatRender(llm.tokenizer, server.model_name, body.top_logprobs, tools)
        return await server.run(request, job, render, body.stream, body.include_usage)

    app.include_router(v1)
    return app
