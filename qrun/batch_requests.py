"""Batch requests: JSON objects with a prompt or messages and their own sampling fields (a line of
`qrun generate --input`, or a row of a Ray Data dataset for `QrunPredictor`), checked and turned
into engine input, and answered with one flat dict each.

Both paths own nothing of this themselves, so a request means the same on one engine and on many
replicas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qrun.errors import QrunError
from qrun.options import SAMPLING_FIELDS
from qrun.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from qrun.llm import LLM
    from qrun.sequence import RequestOutput

# Fields a request may carry besides its prompt: the sampling flags, plus a few SamplingParams
# fields with no flag of their own. n and logprobs change the output shape.
REQUEST_SAMPLING_FIELDS = (*SAMPLING_FIELDS, "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                           "logit_bias")
# A request's structured output, in OpenAI's shape or as a bare schema.
REQUEST_FORMAT_FIELDS = ("response_format", "json_schema")
REQUEST_FIELDS = ("prompt", "messages", "id", *REQUEST_SAMPLING_FIELDS, *REQUEST_FORMAT_FIELDS)
# What an answered request gets; a refused one gets "error" instead. What stopped it is vLLM's
# stop_reason split by type (the stop string, or the stop_token_ids entry; both null for EOS, a
# grammar's end or the length), so that an Arrow column (ray_batch.py) can hold each.
ANSWER_FIELDS = ("text", "token_ids", "finish_reason", "stop_string", "stop_token_id", "prompt_tokens",
                 "completion_tokens", "cached_tokens")


@dataclass(frozen=True)
class BatchDefaults:
    """What every request of a batch starts from: SamplingParams fields (its own fields win), and
    whether a plain prompt is wrapped in the chat template."""

    sampling: dict[str, Any] = field(default_factory=dict)
    chat: bool = False


class RefusedRequest(QrunError, ValueError):
    """A request that cannot run; `index` is its place in the batch."""

    def __init__(self, index: int, reason: str):
        super().__init__(reason)
        self.index = index


def parse_request_line(text: str) -> dict[str, Any]:
    """One JSON line -> its request object; ValueError says what is wrong with it."""
    try:
        request = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(request, dict):
        raise ValueError("not a JSON object")
    return request


def prepare_request(llm: "LLM", request: dict[str, Any], defaults: BatchDefaults) -> tuple[list[int], SamplingParams]:
    """A request -> (prompt ids, params), checked against `llm`; ValueError says what is wrong with it."""
    from qrun.tokenizer import chat_messages

    unknown = sorted(set(request) - set(REQUEST_FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    prompt, messages = request.get("prompt"), request.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError('give exactly one of "prompt" or "messages"')
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError('"prompt" must be a non-empty string')
        if defaults.chat:
            messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        messages = chat_messages(messages)
    fields = {k: v for k, v in request.items() if k in REQUEST_SAMPLING_FIELDS}
    if "response_format" in request and "json_schema" in request:
        raise ValueError('give "response_format" or "json_schema", not both')
    if "response_format" in request:
        fields["structured_outputs"] = StructuredOutputsParams.from_response_format(request["response_format"])
    elif "json_schema" in request:
        fields["structured_outputs"] = StructuredOutputsParams(json=request["json_schema"])
    try:
        params = SamplingParams(**{**defaults.sampling, **fields})
    except TypeError as err:  # a string where a number belongs fails SamplingParams' comparisons
        raise ValueError(f"a sampling field has the wrong type ({err})") from None
    ids = llm.tokenizer.encode_chat(messages) if messages is not None else llm.tokenizer.encode(prompt)
    # Checked here rather than left to the engine, which would reject the whole batch.
    limit = llm.engine.request_token_limit
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) + params.max_tokens > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"{limit} tokens one request may use")
    if params.structured_outputs is not None:
        try:
            llm.engine.grammar_compiler.matcher(params.structured_outputs)  # compiled once, cached for the run
        except QrunError as err:
            raise ValueError(str(err)) from None
    return ids, params


def answer_fields(output: "RequestOutput") -> dict[str, Any]:
    """A finished request's ANSWER_FIELDS."""
    stop = output.stop_reason
    return {"text": output.text, "token_ids": list(output.token_ids), "finish_reason": output.finish_reason,
            "stop_string": stop if isinstance(stop, str) else None,
            "stop_token_id": None if stop is None or isinstance(stop, str) else int(stop),
            "prompt_tokens": output.metrics.num_prompt_tokens, "completion_tokens": len(output.token_ids),
            "cached_tokens": output.metrics.num_cached_tokens}


def answer_requests(llm: "LLM", requests: list[dict[str, Any]], defaults: BatchDefaults, *, strict: bool = False,
                    progress: bool = False) -> list[dict[str, Any]]:
    """Run the requests through `llm` as one continuous batch: per request, in order, its
    ANSWER_FIELDS, or {"error": why} for one that cannot run. `strict`: raise RefusedRequest for
    the first such request instead, before generating anything."""
    answers: list[dict[str, Any]] = []
    runnable: list[tuple[int, list[int], SamplingParams]] = []  # (index in answers, ids, params)
    for index, request in enumerate(requests):
        try:
            ids, params = prepare_request(llm, request, defaults)
        except ValueError as err:
            if strict:
                raise RefusedRequest(index, str(err)) from None
            answers.append({"error": str(err)})
            continue
        runnable.append((len(answers), ids, params))
        answers.append({})
    if runnable:
        outputs = llm.generate([ids for _, ids, _ in runnable], [params for _, _, params in runnable],
                               progress=progress)
        for (index, _, _), output in zip(runnable, outputs):
            answers[index] = answer_fields(output)
    return answers
