"""Batch jobs on Ray Data: `QrunPredictor`, the callable class that gives each Ray actor its own
engine, and `answer_on_ray`, which runs `qrun generate --input ... --replicas N` with it.

    ds = ray.data.read_json("requests.jsonl")
    ds = ds.map_batches(QrunPredictor, fn_constructor_kwargs={"model": "smollm2-135m", "max_num_seqs": 64,
                        "sampling": {"temperature": 0}}, batch_format="pyarrow", batch_size=256,
                        compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1)

(`concurrency=4` says the same; Ray 2.51+ prefers `compute`.) Actors hold their CPUs for the whole
job: leave one free for the read and write tasks, which otherwise wait forever.

A row is a request as `qrun generate --input` reads it (batch_requests.py): "prompt" or
"messages", optionally "id" and sampling fields; a column that is null in a row counts as absent
(Arrow fills the columns a row lacks with nulls). Requests whose nested fields differ in shape
from row to row (JSON schemas, say) belong whole, as JSON text, in a "request" column instead:
Arrow gives a column one type for all rows. Every input column comes out as it went in, with
ANSWER_FIELDS and "error" (null unless the row was refused) added.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pyarrow as pa

from qrun.batch_requests import (ANSWER_FIELDS, REQUEST_FIELDS, BatchDefaults, answer_requests,
                                 parse_request_line)
from qrun.errors import QrunError
from qrun.replicas import ReplicaSpec, connect, gpus_per_replica, model_for_replicas, replicas_failed
from qrun.sampling_params import SamplingParams

REQUEST_COLUMN = "request"
_ANSWER_TYPES = {"text": pa.string(), "token_ids": pa.list_(pa.int64()), "finish_reason": pa.string(),
                 "stop_string": pa.string(), "stop_token_id": pa.int64(), "prompt_tokens": pa.int64(),
                 "completion_tokens": pa.int64(), "cached_tokens": pa.int64(), "error": pa.string()}
# Explicit types: a batch whose answers are all null (all refused) must still match the others.
ANSWER_SCHEMA = pa.schema([(name, _ANSWER_TYPES[name]) for name in (*ANSWER_FIELDS, "error")])

# Each replica takes several batches, so a faster one takes more of the work and a replica that
# dies costs one batch of redone work; the cap bounds that cost on huge jobs. Fewer, bigger
# batches keep more requests in each engine's continuous batch.
BATCHES_PER_REPLICA = 4
MAX_BATCH_ROWS = 1024


class QrunPredictor:
    """One `LLM` per Ray actor, answering each batch (a pyarrow Table) through it as one
    continuous batch. `engine_args` are EngineConfig fields; `sampling` holds SamplingParams
    fields every row starts from; `chat` wraps plain prompts in the chat template."""

    def __init__(self, model: str, *, sampling: dict[str, Any] | None = None, chat: bool = False,
                 **engine_args: Any):
        from qrun.llm import LLM

        self.defaults = BatchDefaults(dict(sampling or {}), chat)
        SamplingParams(**self.defaults.sampling)  # bad defaults fail here, before the model loads
        self.llm = LLM(model, **engine_args)

    def __call__(self, batch: pa.Table) -> pa.Table:
        if not isinstance(batch, pa.Table):
            # Numpy and pandas batches turn a missing integer into NaN (3 and null -> 3.0 and nan).
            raise TypeError(f"QrunPredictor takes batch_format='pyarrow' batches, not {type(batch).__name__}")
        wanted = [name for name in batch.column_names if name in REQUEST_FIELDS or name == REQUEST_COLUMN]
        answers: list[dict[str, Any] | None] = []
        requests: list[tuple[int, dict[str, Any]]] = []  # (index in answers, request)
        for row in batch.select(wanted).to_pylist():
            try:
                requests.append((len(answers), _request_of(row)))
                answers.append(None)
            except ValueError as err:
                answers.append({"error": str(err)})
        for (index, _), answer in zip(requests, answer_requests(self.llm, [r for _, r in requests], self.defaults)):
            answers[index] = answer
        for column in ANSWER_SCHEMA:
            values = pa.array([answer.get(column.name) for answer in answers], column.type)
            if column.name in batch.column_names:
                batch = batch.set_column(batch.column_names.index(column.name), column, values)
            else:
                batch = batch.append_column(column, values)
        return batch


def _request_of(row: dict[str, Any]) -> dict[str, Any]:
    if row.get(REQUEST_COLUMN) is not None:
        return parse_request_line(row[REQUEST_COLUMN])
    return {name: value for name, value in row.items() if name != REQUEST_COLUMN and value is not None}


def answer_on_ray(model: str, engine_args: dict[str, Any], requests: list[dict[str, Any]],
                  defaults: BatchDefaults, replicas: ReplicaSpec) -> list[dict[str, Any]]:
    """answer_requests' answers, in order, from `replicas.count` replicas on Ray Data."""
    ray = connect(replicas)
    import ray.data

    batch_size = min(MAX_BATCH_ROWS, math.ceil(len(requests) / (BATCHES_PER_REPLICA * replicas.count)))
    inputs = [{"index": index, REQUEST_COLUMN: json.dumps(request)} for index, request in enumerate(requests)]
    answered = ray.data.from_items(inputs).map_batches(
        QrunPredictor, batch_format="pyarrow", batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=replicas.count),
        num_cpus=replicas.cpus, num_gpus=gpus_per_replica(replicas, ray),
        fn_constructor_kwargs={"model": model_for_replicas(model), "sampling": defaults.sampling,
                               "chat": defaults.chat, **engine_args})
    try:
        # Columns picked here, not by a Ray Data projection: its tasks would wait for a CPU that
        # the replicas hold until the job ends.
        outputs = [row for batch in answered.iter_batches(batch_format="pyarrow", batch_size=None)
                   for row in batch.select(["index", *ANSWER_SCHEMA.names]).to_pylist()]
    except Exception as err:  # Ray's report of replicas that failed, tracebacks and all
        raise replicas_failed(str(err)) from err
    answers: list[dict[str, Any] | None] = [None] * len(requests)
    for row in outputs:
        index = row.pop("index")
        if answers[index] is not None:
            raise QrunError(f"Ray returned request {index} twice")
        answers[index] = {"error": row["error"]} if row["error"] is not None else \
            {name: row[name] for name in ANSWER_FIELDS}
    missing = answers.count(None)
    if missing:
        raise QrunError(f"Ray returned {len(requests) - missing} of {len(requests)} requests")
    return answers
