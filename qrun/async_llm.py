"""Many coroutines, one engine: an asyncio front over an engine loop in its own thread.

The engine is not thread-safe, so only the loop thread touches it; coroutines send it
commands through a queue and receive outputs through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import AsyncIterator, Callable

from qrun.errors import EngineStopped
from qrun.heap import HeapTrimmer
from qrun.llm_engine import EngineConfig, LLMEngine, Prompt
from qrun.sampling_params import SamplingParams
from qrun.sequence import RequestOutput
from qrun.sources import DEFAULT_MODEL

log = logging.getLogger("qrun")

Command = tuple[Callable[[], object], Future]  # run on the engine thread; the future gets its result


class AsyncLLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self._stopping = False
        self._stopped_reason: str | None = None
        self._accepting = threading.Lock()  # orders each new command against the loop's end
        self._thread = threading.Thread(target=self._run, name="qrun-engine", daemon=True)
        self._thread.start()

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        reason = "the engine was shut down"
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - said loudly, to every waiting client and to /health
            log.critical("the engine loop failed: no request can be served until the process restarts",
                         exc_info=True)
            reason = f"the engine loop failed ({type(err).__name__}: {err})"
        self._close(reason)

    def _serve(self) -> None:
        engine = self.engine
        heap = HeapTrimmer()
        while not self._stopping:
            if not engine.has_unfinished_requests():
                heap.on_idle()
            # Block while idle; between steps, take every pending command without waiting.
            try:
                _run_command(*self._commands.get(timeout=None if not engine.has_unfinished_requests() else 0))
                while True:
                    _run_command(*self._commands.get_nowait())
            except queue.Empty:
                pass
            self._stats = engine.stats()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # noqa: BLE001 - a fault no one request caused: fail them all, never the loop
                log.exception("an engine step failed; failing every request")
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._deliver(request_id, err)
                continue
            self._stats = engine.stats()
            for output in outputs:
                self._deliver(output.request_id, output)
            heap.after_step()

    def _close(self, reason: str) -> None:
        """Refuse new commands, and fail the pending ones and every open stream, with `reason`."""
        with self._accepting:
            self._stopped_reason = reason
        error = EngineStopped(reason)
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        for loop, stream in list(self._streams.values()):
            _send(loop, stream, error)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None and not _send(*target, item):
            # Its event loop closed while the stream was open: nobody will read it.
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def _call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread; the future carries its result or exception
        (EngineStopped once the loop has ended)."""
        future: Future = Future()
        with self._accepting:
            if self._stopped_reason is None:
                self._commands.put((fn, future))
                return future
        future.set_exception(EngineStopped(self._stopped_reason))
        return future

    # -- public -----------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative outputs until it finishes.

        Invalid requests raise here, before the first output. Leaving the iteration early
        (a client that went away) aborts the request and frees its blocks. A request the engine
        fails ends with finish_reason "error" and `error` saying why; a step that fails outside
        any one request raises its exception here, and a stopped engine raises EngineStopped.
        """
        request_id = request_id or f"async-{next(self._ids)}"
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            await asyncio.wrap_future(self._call(lambda: self.engine.add_request(request_id, prompt, params)))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._call(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._call(lambda: self.engine.abort(request_id)))

    def stats(self) -> dict[str, float]:
        """Engine statistics as of the last step (read without waiting for the engine)."""
        return dict(self._stats)

    @property
    def stopped_reason(self) -> str | None:
        """Why the engine serves no more requests (shut down, or its loop failed); None while it does."""
        return self._stopped_reason

    def shutdown(self) -> None:
        self._stopping = True
        self._call(lambda: None)  # wakes the loop if it waits for work
        self._thread.join(timeout=10)


def _run_command(fn: Callable[[], object], future: Future) -> None:
    if not future.set_running_or_notify_cancel():  # its caller stopped waiting: an add it no longer wants
        return
    try:
        future.set_result(fn())
    except BaseException as err:  # noqa: BLE001 - the caller's to handle
        future.set_exception(err)


def _send(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item: RequestOutput | BaseException) -> bool:
    """Put `item` on a stream owned by another thread's event loop; False if that loop has closed."""
    try:
        loop.call_soon_threadsafe(stream.put_nowait, item)
    except RuntimeError:
        return False
    return True
