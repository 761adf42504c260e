"""A sequence: one completion being generated, and the outputs a request reports."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from qrun.sampling_params import SamplingParams
from qrun.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from qrun.structured_outputs import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or "error" when the engine failed the request
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS, a grammar)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sampled tokens' logprobs summed (None where logprobs were not asked for), as vLLM's."""
        return None if self.logprobs is None else sum(entry[t] for t, entry in zip(self.token_ids, self.logprobs))


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # a request failed before its prompt was done has only the first
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # why the engine failed the request (its completions end with "error")

    # The common n=1 case reads like vLLM's first completion.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


@dataclass(eq=False)
class Sequence:
    """The token ids of one completion and where its K/V live in the cache.

    `num_computed_tokens` counts the leading tokens whose K/V are in the cache; the rest are
    fed to the model by later steps. After preemption it drops to zero and the sequence is
    recomputed from its prompt and the tokens it had already produced.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained names of its full blocks
    text: str = ""  # output text, cut at a stop string
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict[int, float]] | None = None
    num_preemptions: int = 0
    matcher: "Matcher | None" = None  # where its structured output stands (qrun/structured_outputs.py)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating the whole sequence (the per-step hot path)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.token_ids[start:end]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> str:
        """Record a sampled token; return the text it added (before stop-string handling)."""
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_token_ids.append(token_id)
        return self.detokenizer.add(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.time()

    @property
    def visible_text(self) -> str:
        """The output text minus a tail that may still become a stop string.

        It only ever grows, so streaming callers send the difference between two reads.
        """
        if self.finished or not self.params.stop_strings:
            return self.text
        return self.text[:len(self.text) - _stop_prefix_overlap(self.text, self.params.stop_strings)]

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.visible_text, list(self.output_token_ids), self.finish_reason,
                                None if self.logprobs is None else list(self.logprobs), self.stop_reason)


def _stop_prefix_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best
