"""The offline API: `LLM(model).generate(prompts, params)`, `LLM.chat` and `LLM.stream`."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator, Sequence as Seq

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qrun.errors import RequestError, RequestFailed
from qrun.llm_engine import EngineConfig, LLMEngine, Prompt
from qrun.sampling_params import SamplingParams
from qrun.sequence import RequestOutput
from qrun.sources import DEFAULT_MODEL
from qrun.tokenizer import chat_messages

Conversation = list[dict[str, Any]]  # chat messages: {"role": ..., "content": ...}


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args):
        """Load `model` (folder, .gguf, alias or hub id); `engine_args` are EngineConfig fields."""
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, progress: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; outputs in input order.

        A request the engine fails (a fault in its own processing, or a failed forward pass of
        its step) ends with finish_reason "error" and `error` saying why; the others run on.
        """
        if not isinstance(prompts, (list, tuple)) or (prompts and not isinstance(prompts[0], (str, dict, list, tuple))):
            prompts = [prompts]  # one prompt: text, a dict or token ids
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        engine = self.engine
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                engine.add_request(request_id, prompt, p)
            # on stderr, and only where it is a terminal: a script's piped output or log file gets no bar's remains
            console = Console(stderr=True)
            with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console,
                          disable=not (progress and console.is_terminal), transient=True) as bar:
                task = bar.add_task("", total=len(ids), rate="")
                start_tokens = engine.num_generated_tokens
                start = bar.get_time()
                while len(finished) < len(ids):
                    for output in engine.step(finished_only=True):
                        finished[output.request_id] = output
                    elapsed = max(bar.get_time() - start, 1e-9)
                    bar.update(task, completed=len(finished),
                               rate=f"{(engine.num_generated_tokens - start_tokens) / elapsed:.1f} tok/s")
        finally:  # an invalid prompt or a failed step: nobody will collect the others' answers
            for request_id in ids:
                if request_id not in finished:
                    engine.abort(request_id)
        return [finished[request_id] for request_id in ids]

    def chat(self, messages: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *, chat_template: str | None = None,
             tools: list[dict[str, Any]] | None = None, progress: bool = True) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to each of a list of
        them, rendered by the model's chat template (or `chat_template`, with `tools` where it writes
        them) as `qrun chat` and the server render theirs; then `generate`, outputs in input order."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for index, conversation in enumerate(conversations):
            try:
                checked = chat_messages(conversation)
            except ValueError as err:
                where = f"conversation {index}: " if len(conversations) > 1 else ""
                raise RequestError(f"{where}{err}") from None
            prompts.append(self.tokenizer.encode_chat(checked, template=chat_template, tools=tools))
        return self.generate(prompts, sampling_params, progress=progress)

    def stream_outputs(self, prompt: Prompt, sampling_params: SamplingParams | None = None
                       ) -> Iterator[RequestOutput]:
        """Yield one request's cumulative output after every step that advances it.

        Closing the iterator early aborts the request and frees its blocks. A request the engine
        fails ends with finish_reason "error" and `error` saying why.
        """
        engine = self.engine
        request_id = f"stream-{next(self._ids)}"
        engine.add_request(request_id, prompt, sampling_params)
        try:
            while True:
                for output in engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            engine.abort(request_id)  # a no-op once finished

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is produced (stop strings already cut).

        Raises RequestFailed if the engine fails the request (text alone cannot say so).
        """
        sent = 0
        # Closed here, not left to the garbage collector: on CPython 3.12 closing this generator did
        # not free that one, so its abort waited, then landed in the middle of a later step.
        with contextlib.closing(self.stream_outputs(prompt, sampling_params)) as outputs:
            for output in outputs:
                if len(output.text) > sent:
                    yield output.text[sent:]
                    sent = len(output.text)
                if output.error is not None:
                    raise RequestFailed(output.error)
