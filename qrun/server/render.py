"""Response bodies in OpenAI's shapes: a job's whole answer, or its stream as server-sent events."""

from __future__ import annotations

import json
from dataclasses import dataclass

from qrun.sequence import CompletionOutput, RequestOutput
from qrun.server.job import Job
from qrun.server.tools import ToolCalling
from qrun.tokenizer import Tokenizer

STREAM_END = "data: [DONE]\n\n"


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(outputs: dict[int, RequestOutput]) -> dict[str, int]:
    """OpenAI's usage object over a job's latest outputs (one per prompt)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class ChoiceState:
    """What has been sent of one choice, so each chunk carries only the new part."""

    text_sent: int = 0
    logprobs_sent: int = 0
    finished: bool = False

    def advance(self, choice: CompletionOutput) -> tuple[str, list] | None:
        """The text and logprobs `choice` added since the last chunk, now counted as sent; None
        once its finishing chunk has gone, or when it added nothing."""
        if self.finished:
            return None
        text = choice.text[self.text_sent:]
        new_logprobs = (choice.logprobs or [])[self.logprobs_sent:]
        self.text_sent, self.logprobs_sent = len(choice.text), len(choice.logprobs or [])
        self.finished = choice.finish_reason is not None
        return (text, new_logprobs) if text or self.finished else None


class Render:
    """One request's bodies for one endpoint: `answer` whole, or a stream's chunks, each with
    only what is new since the last (so an instance serves one request)."""

    answer_object = ""
    chunk_object = ""

    def __init__(self, tokenizer: Tokenizer, model_name: str):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.sent: dict[tuple[int, int], ChoiceState] = {}  # by (prompt index, choice index)

    def answer(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        raise NotImplementedError

    def _delta(self, job: Job, index: int, output: RequestOutput, choice: CompletionOutput, text: str,
               logprobs: list[dict[int, float]] | None, opening: bool) -> dict | None:
        """One streamed choice: its new `text` and `logprobs`; `opening` when nothing of it was
        sent. None: nothing to send yet."""
        raise NotImplementedError

    def first_chunks(self, job: Job) -> list[dict]:
        return []

    def delta_chunks(self, job: Job, index: int, output: RequestOutput) -> list[dict]:
        """A chunk per choice of prompt `index` that has new text or just finished."""
        chunks = []
        for choice in output.outputs:
            state = self.sent.setdefault((index, choice.index), ChoiceState())
            opening = state.text_sent == 0
            if (new := state.advance(choice)) is None:
                continue
            text, logprobs = new
            delta = self._delta(job, index, output, choice, text,
                                logprobs if choice.logprobs is not None else None, opening)
            if delta is not None:
                chunks.append({**self._header(job, self.chunk_object), "choices": [delta]})
        return chunks

    def usage_chunk(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        return {**self._header(job, self.chunk_object), "choices": [], "usage": usage(outputs)}

    def _header(self, job: Job, obj: str) -> dict:
        return {"id": job.request_id, "object": obj, "created": int(job.started), "model": self.model_name}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionRender(Render):
    """Bodies of /v1/completions: choices[i].text, logprobs in the legacy shape."""

    answer_object = chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, model_name: str, echo: bool):
        super().__init__(tokenizer, model_name)
        self.echo = echo

    def _logprobs(self, entries: list[dict[int, float]] | None, k: int | None) -> dict | None:
        if entries is None:
            return None
        tokens, values, tops = [], [], []
        for entry in entries:
            token_id, value = next(iter(entry.items()))  # the sampled token comes first
            tokens.append(self._token_text(token_id))
            values.append(value)
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:k or 0]
            tops.append({self._token_text(t): v for t, v in best} if k else None)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": []}

    def answer(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        choices = []
        for index, output in sorted(outputs.items()):
            for c in output.outputs:
                prefix = output.prompt if self.echo and output.prompt else ""
                choices.append({"index": index * job.params.n + c.index, "text": prefix + c.text,
                                "logprobs": self._logprobs(c.logprobs, job.params.logprobs),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**self._header(job, self.answer_object), "choices": choices, "usage": usage(outputs)}

    def _delta(self, job: Job, index: int, output: RequestOutput, choice: CompletionOutput, text: str,
               logprobs: list[dict[int, float]] | None, opening: bool) -> dict:
        if opening and self.echo and output.prompt:
            text = output.prompt + text
        return {"index": index * job.params.n + choice.index, "text": text,
                "logprobs": self._logprobs(logprobs, job.params.logprobs), "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}


class ChatRender(Render):
    """Bodies of /v1/chat/completions: an assistant message, logprobs in the content shape."""

    answer_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, model_name: str, top_logprobs: int, tools: ToolCalling | None = None):
        super().__init__(tokenizer, model_name)
        self.top_logprobs = top_logprobs
        self.tools = tools  # with tools, a choice is held back until it ends: it may be a call, not text

    def _logprobs(self, entries: list[dict[int, float]] | None) -> dict | None:
        if entries is None:
            return None

        def item(token_id: int, value: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        content = []
        for entry in entries:
            token_id, value = next(iter(entry.items()))
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            content.append({**item(token_id, value), "top_logprobs": [item(t, v) for t, v in best]})
        return {"content": content}

    def _tool_calls(self, choice: CompletionOutput) -> list[dict] | None:
        if self.tools is None or choice.finish_reason != "stop":
            return None
        return self.tools.parse(choice.text)

    def answer(self, job: Job, outputs: dict[int, RequestOutput]) -> dict:
        choices = []
        for c in outputs[0].outputs:
            calls = self._tool_calls(c)
            message = ({"role": "assistant", "content": None, "tool_calls": calls} if calls
                       else {"role": "assistant", "content": c.text})
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.logprobs),
                            "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason})
        return {**self._header(job, self.answer_object), "choices": choices, "usage": usage(outputs)}

    def first_chunks(self, job: Job) -> list[dict]:
        # OpenAI opens each choice with its role and empty content.
        return [{**self._header(job, self.chunk_object), "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
             "stop_reason": None}]}
            for i in range(job.params.n)]

    def _delta(self, job: Job, index: int, output: RequestOutput, choice: CompletionOutput, text: str,
               logprobs: list[dict[int, float]] | None, opening: bool) -> dict | None:
        if self.tools is not None:
            if choice.finish_reason is None:
                return None
            calls = self._tool_calls(choice)
            if calls:  # OpenAI streams each call with its index; here each arrives whole
                streamed = [{"index": i, **call} for i, call in enumerate(calls)]
                return {"index": choice.index, "delta": {"tool_calls": streamed},
                        "logprobs": self._logprobs(choice.logprobs), "finish_reason": "tool_calls",
                        "stop_reason": choice.stop_reason}
            text, logprobs = choice.text, choice.logprobs  # held back until now
        return {"index": choice.index, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(logprobs), "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason}
