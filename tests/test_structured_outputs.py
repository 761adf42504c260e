"""Structured outputs: constrained and free requests share steps; every finished constrained
output matches its constraint; bad constraints fail before admission, naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun import LLM, SamplingParams
from qrun.errors import RequestError
from qrun.kernels import cpu_library, ops_for
from qrun.kernels.cpu_token_bitmask import mask_logits_cpu
from qrun.kernels.token_bitmask import mask_logits_ref
from qrun.sampling_params import InvalidSamplingParam, StructuredOutputsParams
from qrun.structured_outputs import apply_bitmask

GREEDY = dict(temperature=0)

# Each schema exercises features clients send: nesting, arrays with bounds, enums, numbers with
# bounds, required and optional keys, $ref/$defs, anyOf, string patterns and formats.
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"}}, "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3},
                       "status": {"enum": ["open", "paid", "shipped"]}},
        "required": ["items", "status"], "additionalProperties": False},
    "measurement": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "number", "minimum": -10, "maximum": 10}, {"type": "null"}]},
        "unit": {"type": "string", "enum": ["m", "s", "kg"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["value", "unit"], "additionalProperties": False},
}
PROMPTS = ["Give me an example as JSON.", "Here is the record:"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=4_000_000, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return LLM(str(smollm2_gguf), kv_cache_memory=200_000_000)


def constrained(max_tokens=40, **kind):
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind), **GREEDY)


@pytest.mark.parametrize("kind, error", [
    (dict(), "exactly one of"),
    (dict(json={"type": "object"}, regex="a"), "got json, regex"),
    (dict(choice=[]), "non-empty list"),
    (dict(json="{not json"), "not JSON"),
    (dict(regex=""), "non-empty string"),
])
def test_malformed_structured_outputs_params_name_the_field(kind, error):
    with pytest.raises(InvalidSamplingParam, match=error) as raised:
        StructuredOutputsParams(**kind)
    assert raised.value.name.startswith("structured_outputs")


@pytest.mark.parametrize("kind, field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strng"}}}), "json"),
    (dict(regex="a{2,1}"), "regex"),
    (dict(regex=r"[^\s\S]"), "regex"),  # well formed, but nothing matches it
    (dict(grammar="start: undefined_rule"), "grammar"),
])
def test_unservable_constraint_is_rejected_before_admission(tiny, kind, field):
    with pytest.raises(RequestError, match=f"structured_outputs.{field}: ") as raised:
        tiny.generate(["hi"], constrained(**kind), progress=False)
    assert raised.value.param == field
    assert not tiny.engine.has_unfinished_requests()
    # the engine serves on; EOS ignored, as this random model samples it at a rate that hangs on torch's global RNG
    served = tiny.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True), progress=False)[0]
    assert served.finish_reason == "length"


def test_choice_and_regex_hold_for_greedy_sampled_and_n_beside_free_requests(tiny):
    free = [[5, 6, 7, 8], [9, 10, 11]]
    choices = ["red", "green", "blue sky"]
    requests = [
        ([1, 2, 3], constrained(choice=choices)),
        ([4, 5], SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=3,
                                structured_outputs=StructuredOutputsParams(choice=choices))),
        ([6, 7], constrained(max_tokens=20, regex="[a-z]{2,4}-[0-9]{2}")),
        ([8], SamplingParams(max_tokens=20, temperature=0.9, seed=5,
                             structured_outputs=StructuredOutputsParams(regex="(yes|no), [0-9]+ items"))),
        *[(prompt, SamplingParams(max_tokens=12, **GREEDY, ignore_eos=True)) for prompt in free],
    ]
    outputs = tiny.generate([r[0] for r in requests], [r[1] for r in requests], progress=False)
    assert outputs[0].text in choices and outputs[0].finish_reason == "stop"
    assert all(c.text in choices and c.finish_reason == "stop" for c in outputs[1].outputs)
    assert re.fullmatch("[a-z]{2,4}-[0-9]{2}", outputs[2].text)
    if outputs[3].finish_reason == "stop":
        assert re.fullmatch("(yes|no), [0-9]+ items", outputs[3].text)
    else:  # out of tokens inside the number: a prefix of a match
        assert re.fullmatch("(yes|no), [0-9]+", outputs[3].text)
    for prompt, out in zip(free, outputs[4:]):  # constrained neighbours change nothing
        assert out.token_ids == tiny.generate([prompt], SamplingParams(max_tokens=12, **GREEDY, ignore_eos=True),
                                              progress=False)[0].token_ids


def test_constrained_output_survives_preemption(tiny_llama_dir, tiny):
    small = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory=60_000, max_num_seqs=8,
                max_num_batched_tokens=64)
    prompts = [[i + 1] * (10 + 3 * i) for i in range(8)]
    params = constrained(max_tokens=40, regex="([a-z]+ ){3,8}end")
    outs = small.generate(prompts, params, progress=False)
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == tiny.generate([prompt], params, progress=False)[0].token_ids


def test_json_whitespace_is_bounded_unless_the_schema_sets_its_own(tiny):
    booleans = {"type": "array", "items": {"type": "boolean"}}

    def accepts(schema, text):
        ids = tiny.tokenizer.encode(text, add_special_tokens=False)
        matcher = tiny.engine.grammar_compiler.matcher(StructuredOutputsParams(json=schema))
        return matcher._matcher.validate_tokens(ids) == len(ids)

    for text in ("[true,false]", "[true, false]", "[\n  true,\n\n\tfalse\n]", "{}"):
        assert accepts(booleans, text) == (text != "{}")
    for text in ("[true,  false]", "[true," + " " * 21 + "\nfalse]", "[\n\n\ntrue]"):
        assert not accepts(booleans, text)
        assert accepts({**booleans, "x-guidance": {"whitespace_flexible": True}}, text)
    assert not accepts({**booleans, "x-guidance": {"whitespace_flexible": False}}, "[\n  true]")
    assert accepts(True, "[true,   false]")  # a boolean schema takes no options


@pytest.mark.slow
def test_every_finished_json_output_validates_against_its_schema(smollm2):
    requests = []
    for name, schema in SCHEMAS.items():
        for prompt in PROMPTS:
            requests.append((f"{prompt} ({name})", constrained(max_tokens=100, json=schema), schema))
            requests.append((f"{prompt} ({name})", SamplingParams(
                max_tokens=100, temperature=0.8, seed=len(requests),
                structured_outputs=StructuredOutputsParams(json=json.dumps(schema))), schema))
    free = ["The capital of France is", "Once upon a time"]
    free_params = SamplingParams(max_tokens=16, **GREEDY, ignore_eos=True)
    outputs = smollm2.generate([r[0] for r in requests] + free, [r[1] for r in requests] + [free_params] * 2,
                               progress=False)
    finished = 0
    for (_, _, schema), out in zip(requests, outputs):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
            finished += 1
    assert finished >= len(requests) * 3 // 4
    for prompt, out in zip(free, outputs[len(requests):]):
        assert out.token_ids == smollm2.generate([prompt], free_params, progress=False)[0].token_ids


@pytest.mark.slow
def test_json_object_gives_an_object(smollm2):
    out = smollm2.generate(["A JSON object describing a cat:"], constrained(max_tokens=80, json_object=True),
                           progress=False)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.text.startswith("{")


@settings(max_examples=40, deadline=None)
@given(constrained=st.lists(st.booleans(), min_size=1, max_size=7), seed=st.integers(0, 2**16))
def test_a_steps_bitmask_masks_its_constrained_rows_and_leaves_the_others(constrained, seed):
    """The sampler's batch holds constrained rows anywhere among free ones; the bitmask has one row
    per constrained row, in batch order."""
    gen = torch.Generator().manual_seed(seed)
    vocab, rows = 70, [row for row, flag in enumerate(constrained) if flag]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=gen)
    logits = torch.randn(len(constrained), vocab, generator=gen)
    expected = logits.clone()
    picked = expected[rows]
    mask_logits_ref(picked, bitmask)
    expected[rows] = picked
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


MASK_LOGITS = [mask_logits_ref,
               pytest.param(mask_logits_cpu, marks=pytest.mark.skipif(not cpu_library.available(),
                                                                      reason="the C++ kernels did not build here"))]


@pytest.mark.parametrize("mask_logits", MASK_LOGITS)
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 300), share=st.floats(0.0, 1.0), short=st.booleans(),
       seed=st.integers(0, 2**16))
def test_a_token_mask_leaves_exactly_the_allowed_tokens(mask_logits, rows, vocab, share, short, seed):
    """Bit t % 32 of word t // 32, the top bit (the sign) included; a mask shorter than the vocabulary
    forbids the tokens past it."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=gen) < share
    words = max(1, (vocab + 31) // 32 - short)
    padded = torch.zeros(rows, words * 32 + 32, dtype=torch.bool)
    padded[:, :vocab] = allowed
    bits = (padded[:, :words * 32].view(rows, words, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    logits = torch.randn(rows, vocab, generator=gen)
    mask_logits(logits, bitmask)
    expected = allowed.clone()
    expected[:, words * 32:] = False
    assert torch.equal(logits.isfinite(), expected)
    if cpu_library.available():
        assert ops_for(torch.device("cpu")).mask_logits is mask_logits_cpu  # what the sampler takes here


def test_logprobs_of_a_constrained_row_list_only_allowed_tokens(tiny):
    params = SamplingParams(max_tokens=5, logprobs=5, structured_outputs=StructuredOutputsParams(choice=["ab", "cd"]),
                            **GREEDY)
    out = tiny.generate([[3, 4]], params, progress=False)[0]
    assert all(all(value > float("-inf") for value in entry.values()) for entry in out.logprobs)
    assert torch.isfinite(torch.tensor([v for entry in out.logprobs for v in entry.values()])).all()


def test_batch_lines_take_response_format_or_json_schema_and_bad_ones_are_skipped(tiny_llama_dir, tmp_path, capsys):
    from qrun.cli import main

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    lines = [
        {"prompt": "a", "max_tokens": 30, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}},
        {"prompt": "b", "max_tokens": 30, "temperature": 0, "json_schema": schema},
        {"prompt": "c", "max_tokens": 5, "json_schema": {"type": "object", "properties": {"x": {"type": "strng"}}}},
        {"prompt": "d", "max_tokens": 5, "response_format": {"type": "yaml"}},
        {"prompt": "e", "max_tokens": 4, "temperature": 0},
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main(["generate", str(tiny_llama_dir), "--input", str(source), "--output", str(target),
                 "--dtype", "float32", "--kv-cache-memory", "4000000"]) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [("error" in r) for r in records] == [False, False, True, True, False]
    for record in records[:2]:
        if record["finish_reason"] == "stop":
            jsonschema.validate(json.loads(record["text"]), schema)
    err = capsys.readouterr().err
    assert "structured_outputs.json: " in err and "response_format.type" in err


def test_json_schema_flag_reads_the_schema_file(tiny_llama_dir, tmp_path, capsys):
    from qrun.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps({"enum": ["alpha", "beta"]}))
    assert main(["generate", str(tiny_llama_dir), "hi", "--json-schema", str(schema_file), "--temperature", "0",
                 "--max-tokens", "10", "--dtype", "float32", "--kv-cache-memory", "4000000"]) == 0
    assert capsys.readouterr().out.strip() in ('"alpha"', '"beta"')
    with pytest.raises(SystemExit) as usage:
        main(["generate", str(tiny_llama_dir), "hi", "--json-schema", str(tmp_path / "missing.json")])
    assert usage.value.code == 2
