"""A Job: what one HTTP request asks of the engine (one engine request per prompt, n choices each),
its timings, and its outputs merged across prompts as they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from qrun.async_llm import AsyncLLM
from qrun.errors import RequestFailed
from qrun.sampling_params import SamplingParams
from qrun.sequence import RequestOutput

PromptOutput = tuple[int, RequestOutput]  # (index of the prompt in the job, its newest output)


@dataclass
class Job:
    request_id: str
    prompts: list[str | list[int]]
    params: SamplingParams
    started: float = field(default_factory=time.time)
    first_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def merged_outputs(llm: AsyncLLM, job: Job) -> AsyncIterator[PromptOutput]:
    """Yield (prompt index, output) from all of a job's engine requests as they arrive.

    A request the engine fails raises RequestFailed: the job fails as a whole. Leaving early
    (client gone, or a failure) cancels the per-prompt tasks, whose generators then abort their
    engine requests and free the blocks.
    """
    if len(job.prompts) == 1:  # the common case, without tasks in between
        async with contextlib.aclosing(llm.generate(job.prompts[0], job.params, job.request_id)) as stream:
            async for output in stream:
                yield 0, _succeeded(output)
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prompt: str | list[int]) -> None:
        try:
            async with contextlib.aclosing(llm.generate(prompt, job.params, f"{job.request_id}-{index}")) as stream:
                async for output in stream:
                    queue.put_nowait((index, _succeeded(output)))
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


def _succeeded(output: RequestOutput) -> RequestOutput:
    if output.error is not None:
        raise RequestFailed(output.error)
    return output
