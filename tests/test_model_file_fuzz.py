"""Model files from strangers: a bounded fuzzer over every kind of file qrun reads, and a test
for each defect it (or reading the loaders next to it) found.

Every malformed file must end within CASE_SECONDS in a loaded model or in a one-line error naming
the file: no other exception, no hang, no allocation sized from a header field nothing checked
(tests/model_file_fuzzer.py makes the cases and loads them in a watchdog process). NaN or infinite
weights are refused at load, naming the tensor: a model holding them can only answer with NaN
logits. scripts/fuzz_model_files.py runs larger corpora.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model_file_fuzzer import CASE_SECONDS, KINDS, Watchdog, judge, make_seeds, run_cases, with_gguf_field
from qrun.errors import ModelLoadError
from qrun.loader import load_model
from tiny_gguf import tiny_hf_tensors, write_gguf

CASES = 50 * len(KINDS)  # about 20 s on two busy cores; the script runs thousands
SEED = 0


@pytest.fixture(scope="module")
def seeds(tiny_llama_dir, tmp_path_factory):
    return make_seeds(tmp_path_factory.mktemp("fuzz-seeds"), tiny_llama_dir)


@pytest.fixture(scope="module")
def watchdog(seeds):
    with Watchdog(seeds.models()) as dog:
        yield dog


def test_every_malformed_model_file_loads_or_fails_in_one_line_naming_the_file(seeds, watchdog, tmp_path,
                                                                             summary_line):
    report = run_cases(seeds, SEED, list(range(CASES)), tmp_path, watchdog)
    counts = report.counts()
    summary_line(f"model-file fuzz: {len(report.outcomes)} cases (seed {SEED}): {counts['loaded']} loaded, "
                 f"{counts['clear error']} clear errors ({len(report.distinct_errors())} distinct), "
                 f"{len(report.failures())} failures; slowest {report.slowest():.2f} s")
    failures = "\n".join(f"case {c.index} ({c.mutation}): {o.verdict} after {o.seconds:.1f} s: {o.message}"
                         for c, o in report.failures())
    assert not failures, f"{failures}\n(rerun one with scripts/fuzz_model_files.py --seed {SEED} --case N)"
    by_kind = {kind: {o.verdict for c, o in report.outcomes if c.kind == kind} for kind in KINDS}
    assert all("clear error" in verdicts for verdicts in by_kind.values()), by_kind  # every kind was really broken


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _assert_clear_error(model: Path, file: Path, match: str, **kwargs) -> str:
    with pytest.raises(ModelLoadError, match=match) as caught:
        load_model(model, device="cpu", **kwargs)
    message = str(caught.value)
    assert file.name in message and "\n" not in message, message
    return message


def _assert_clear_error_in_watchdog(watchdog: Watchdog, model: Path, file: Path, match: str) -> None:
    """For inputs that hung or allocated without bound before their fix: the watchdog's time and
    address-space limits turn either into a failure instead of a stuck or swapping test run."""
    from model_file_fuzzer import Case

    answer, seconds = watchdog.load(model)
    outcome = judge(Case(-1, "", "", model, file), answer, seconds)
    assert outcome.verdict == "clear error" and seconds < CASE_SECONDS, outcome
    assert match in outcome.message, outcome.message


# -- config.json -------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", 258, "'rope_scaling' must be an object"),  # was AttributeError
    ("rope_parameters.factor", None, "required field 'factor' is missing"),  # was TypeError
    ("num_attention_heads", 0, "'num_attention_heads' must be an integer from 1"),  # was ZeroDivisionError
    ("intermediate_size", 1e308, "'intermediate_size' must be an integer from 1"),  # was torch's TypeError
    ("rope_theta", 0, "'rope_theta' must be a positive finite number"),  # was ZeroDivisionError
    ("rms_norm_eps", -1.0, "'rms_norm_eps' must be a positive finite number"),  # loaded; NaN logits
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false"),  # loaded as True
])
def test_config_fields_of_the_wrong_type_or_range_are_one_line_errors_naming_the_field(
        tiny_llama_dir, tmp_path, field, value, match):
    folder = _copy(tiny_llama_dir, tmp_path)

    def edit(doc):
        *parents, last = field.split(".")
        for key in parents:
            doc = doc[key]
        doc[last] = value

    _edit_json(folder / "config.json", edit)
    _assert_clear_error(folder, folder / "config.json", match)


@pytest.mark.parametrize("fields, match", [
    # Each was a rotary table of that size, allocated before anything was checked (MemoryError here).
    ({"head_dim": 2**32}, "'head_dim' must be an integer from 1"),  # 128 GiB
    ({"max_position_embeddings": 2**40}, "'max_position_embeddings' must be an integer from 1"),  # 64 TiB
    ({"head_dim": 1024, "max_position_embeddings": 2**20}, "needs a rotary table of 4.0 GiB"),
])
def test_config_claiming_absurd_sizes_fails_before_allocating_them(tiny_llama_dir, tmp_path, watchdog, fields,
                                                                    match):
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "config.json", lambda doc: doc.update(fields))
    _assert_clear_error_in_watchdog(watchdog, folder, folder / "config.json", match)


def test_json_nested_deeper_than_pythons_stack_is_a_one_line_error(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)  # was RecursionError
    _assert_clear_error(folder, folder / "config.json", "is not valid JSON")


@pytest.mark.parametrize("config, match", [
    ("attention_bias", "lacks 6 tensors config.json calls for"),  # was "checkpoint lacks 6 tensors"
    ("vocab_size", "config.json implies"),  # was "checkpoint tensor ... has shape", no file named
])
def test_weights_that_disagree_with_the_config_are_errors_naming_both_files(tiny_llama_dir, tmp_path, config, match):
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "config.json", lambda doc: doc.update({config: True if config == "attention_bias" else 2}))
    message = _assert_clear_error(folder, folder / "model.safetensors", match)
    assert "config.json" in message


# -- tokenizer files ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, match", [
    ("tokenizer_config.json", b'{"bos_token": ', "is not valid JSON"),  # was JSONDecodeError
    ("generation_config.json", b"\xff\xfe\x00{", "is not valid JSON"),  # was UnicodeDecodeError
    ("tokenizer_config.json", b"7", "does not hold a JSON object"),  # was AttributeError
    ("tokenizer_config.json", b'{"eos_token": 7}', "eos_token must be a string"),  # was TypeError
    ("tokenizer_config.json", b'{"chat_template": [1]}', "chat_template must be"),  # was TypeError
    ("generation_config.json", b'{"eos_token_id": "x"}', "eos_token_id must be a token id"),  # loaded as 'x'
])
def test_damaged_tokenizer_configs_are_one_line_errors_naming_them(tiny_llama_dir, tmp_path, name, content, match):
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / name).write_bytes(content)
    _assert_clear_error(folder, folder / name, match)


def test_a_tokenizer_whose_ids_run_past_the_embeddings_is_refused(tiny_llama_dir, tmp_path):
    # Loaded before; the first prompt holding the token then indexed past the embedding table.
    folder = _copy(tiny_llama_dir, tmp_path)
    _edit_json(folder / "tokenizer.json", lambda doc: doc["model"]["vocab"].update({"!": 5000}))
    _assert_clear_error(folder, folder / "tokenizer.json", "token ids run to 5000, past the 300 embeddings")


# -- safetensors -------------------------------------------------------------------------------

def _rewrite_weights(folder: Path, name: str, edit) -> Path:
    path = folder / name
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("tensor, stored_as, match", [
    ("model.norm.weight", torch.int32, "is stored as I32; it must be a float dtype"),
    ("lm_head.weight", torch.uint8, "it must be a float dtype"),
])
def test_a_weight_stored_in_a_dtype_its_parameter_cannot_take_is_refused(tiny_llama_dir, tmp_path, tensor,
                                                                         stored_as, match):
    # Loaded before, converted to floats.
    folder = _copy(tiny_llama_dir, tmp_path)
    file = _rewrite_weights(folder, "model.safetensors", lambda t: t.update({tensor: t[tensor].to(stored_as)}))
    _assert_clear_error(folder, file, match)


def test_a_packed_quantized_tensor_in_another_dtype_is_refused(seeds, tmp_path):
    # A float32 qweight loaded before, truncated to int32 codes.
    folder = _copy(seeds.converted, tmp_path)
    name = "model.layers.0.self_attn.q_proj.qweight"
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]
    file = _rewrite_weights(folder, shard, lambda t: t.update({name: t[name].view(torch.float32)}))
    _assert_clear_error(folder, file, "is stored as F32; it must be int32")


def test_a_tensor_stored_in_two_weight_files_is_refused(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    shutil.copy(folder / "model.safetensors", folder / "model-copy.safetensors")  # loaded before, last one won
    _assert_clear_error(folder, folder / "model.safetensors", "is also in model-copy.safetensors")


def test_a_shard_index_naming_files_outside_the_folder_is_refused(seeds, tmp_path):
    folder = _copy(seeds.converted, tmp_path)
    index = folder / "model.safetensors.index.json"
    outside = str(seeds.folder / "model.safetensors")  # was read, wherever it was
    _edit_json(index, lambda doc: doc["weight_map"].update(dict.fromkeys(doc["weight_map"], outside)))
    _assert_clear_error(folder, index, "shard files of this folder")


def test_a_shard_index_naming_a_missing_shard_names_the_index(seeds, tmp_path):
    folder = _copy(seeds.converted, tmp_path)
    index = folder / "model.safetensors.index.json"
    _edit_json(index, lambda doc: doc["weight_map"].update({"lm_head.qweight": "x"}))  # named only the folder
    _assert_clear_error(folder, index, "names weight shards 'x' that")


# -- quantization_config -----------------------------------------------------------------------

@pytest.mark.parametrize("edit, match", [
    (lambda q: q["modules"]["lm_head"].update(bits=[[3]]), r"modules\['lm_head'\]: bits must be a list"),
    (lambda q: q["modules"]["lm_head"].update(group_size="x"), "group_size 'x' is not a positive multiple"),
    (lambda q: q["modules"]["lm_head"].pop("asym"), "asym must be true or false"),
    (lambda q: q["modules"].update({"model.layers.0": q["modules"].pop("lm_head")}), "no linear layer"),
    (lambda q: q.update(modules=2), "modules must be an object"),
])
def test_malformed_quantization_config_is_a_one_line_error_naming_the_module(seeds, tmp_path, edit, match):
    # Each was a KeyError, TypeError, ValueError or AttributeError from deep inside the loader.
    folder = _copy(seeds.converted, tmp_path)
    _edit_json(folder / "config.json", lambda doc: edit(doc["quantization_config"]))
    _assert_clear_error(folder, folder / "config.json", match)


def test_a_quantization_run_claiming_billions_of_groups_fails_before_allocating_them(seeds, tmp_path, watchdog):
    folder = _copy(seeds.converted, tmp_path)
    _edit_json(folder / "config.json",
               lambda doc: doc["quantization_config"]["modules"]["lm_head"].update(bits=[[4, 2**53]]))
    _assert_clear_error_in_watchdog(watchdog, folder, folder / "config.json", "bits runs cover")  # was MemoryError


# -- GGUF --------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, padding", [
    # gguf's reader took one Python step per claimed item until the file ran out: through 32 MiB of
    # tensor data that is minutes (through a real model's file, hours); now one bounds check.
    ("length of tokenizer.ggml.token_type", 2**40, 32 << 20),
    # A string retyped as an array (scripts/fuzz_model_files.py --seed 1 --case 408): its bytes
    # became arrays of arrays whose reads past the end advanced nothing, so it never ended.
    ("type of general.architecture", 9, 0),
])
def test_a_gguf_array_claiming_more_than_the_file_holds_fails_fast(seeds, tmp_path, watchdog, field, value,
                                                                   padding):
    path = with_gguf_field(seeds.gguf, field, value, tmp_path / "huge.gguf")
    with open(path, "ab") as tail:
        tail.write(bytes(padding))
    _assert_clear_error_in_watchdog(watchdog, path, path, "run past the end of the file")


def test_a_gguf_tensor_with_a_zero_dimension_is_refused(seeds, tmp_path):
    path = with_gguf_field(seeds.gguf, "dimension 1 of blk.0.ffn_up.weight", 0, tmp_path / "zero.gguf")
    _assert_clear_error(path, path, r"tensor blk\.0\.ffn_up\.weight has dimensions \[32, 0\]")  # was ValueError


@pytest.mark.parametrize("field, value", [
    ("offset of blk.0.attn_q.weight", 0),  # overlaps token_embd.weight
    ("type of blk.0.attn_output.weight", 1),  # Q8_0 retyped F16: its bytes read as other numbers
])
def test_gguf_tensors_that_overlap_or_leave_gaps_are_refused(seeds, tmp_path, field, value):
    # Both loaded before, with weights made of some other tensor's bytes.
    path = with_gguf_field(seeds.gguf, field, value, tmp_path / "moved.gguf")
    _assert_clear_error(path, path, "not where the tensor before it ends")


# -- non-finite weights ------------------------------------------------------------------------

def test_nan_or_infinite_weights_are_refused_naming_the_tensor(tiny_llama_dir, seeds, tmp_path):
    """Refused rather than loaded (llama.cpp and vLLM load them): such a model only ever answers
    with NaN logits, which a user meets far from the cause."""
    folder = _copy(tiny_llama_dir, tmp_path)

    def poison(tensors):
        tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")

    file = _rewrite_weights(folder, "model.safetensors", poison)
    _assert_clear_error(folder, file, "'model.layers.1.mlp.up_proj.weight' holds NaN or infinite values")

    weights = tiny_hf_tensors()
    weights["model.layers.0.self_attn.v_proj.weight"][1, 2] = np.inf  # a Q8_0 block with an infinite scale
    with np.errstate(invalid="ignore"):
        write_gguf(tmp_path / "inf.gguf", "llama", weights, quant=True)
    _assert_clear_error(tmp_path / "inf.gguf", tmp_path / "inf.gguf", "v_proj.weight' holds NaN or infinite values")

    converted = _copy(seeds.converted, tmp_path / "q")
    name = "model.layers.1.mlp.down_proj.scale_max"
    shard = json.loads((converted / "model.safetensors.index.json").read_text())["weight_map"][name]
    file = _rewrite_weights(converted, shard, lambda t: t[name].__setitem__(0, float("inf")))
    _assert_clear_error(converted, file, "down_proj.scale_max' holds NaN or infinite values")


def test_a_weight_beyond_float16s_range_asks_for_bfloat16(tiny_llama_dir, tmp_path):
    folder = _copy(tiny_llama_dir, tmp_path)
    file = _rewrite_weights(folder, "model.safetensors", lambda t: t["model.norm.weight"].__setitem__(0, 1e6))
    _assert_clear_error(folder, file, "'model.norm.weight' overflows float16.*bfloat16 or float32", dtype="float16")
    load_model(folder, device="cpu", dtype="bfloat16")  # the same file loads where the value fits
