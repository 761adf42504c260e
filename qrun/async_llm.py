"""Many coroutines, one engine: an asyncio front over an engine loop in its own thread.

The engine is not thread-safe, so only the loop thread touches it; coroutines send it
commands through a queue and receive outputs through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from concurrent.futures import Future
from typing import AsyncIterator, Callable

from qrun.llm_engine import EngineConfig, LLMEngine
from qrun.sampling_params import SamplingParams
from qrun.sequence import RequestOutput
from qrun.sources import DEFAULT_MODEL


class AsyncLLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="qrun-engine", daemon=True)
        self._thread.start()

    # -- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            # Block while idle; between steps, take every pending command without waiting.
            try:
                command = self._commands.get(timeout=None if not engine.has_unfinished_requests() else 0)
                command()
                while True:
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            self._stats = engine.stats()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # a failed step fails its requests, never the loop
                for request_id in list(engine.requests):
                    engine.abort(request_id)
                    self._deliver(request_id, err)
                continue
            self._stats = engine.stats()
            for output in outputs:
                self._deliver(output.request_id, output)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread; the future carries its result or exception."""
        future: Future = Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)

        self._commands.put(command)
        return future

    # -- public -----------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative outputs until it finishes.

        Invalid requests raise here, before the first output. Leaving the iteration early
        (a client that went away) aborts the request and frees its blocks.
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

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)
