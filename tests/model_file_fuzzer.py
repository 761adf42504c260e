"""A bounded fuzzer for model files from strangers: malformed copies of good model files, and a
watchdog process that loads each one.

A case is one mutation of one file of a good model: bytes or header fields of a GGUF, the header
(or a weight) of a safetensors shard, config.json, tokenizer.json, tokenizer_config.json,
generation_config.json, or the quantization_config of a folder written by `qrun convert`.
Loading the result must end within CASE_SECONDS in a loaded model or in a one-line QrunError that
names the mutated file. Loads run in a worker process under an address-space limit, so an
allocation sized from an unchecked header field fails there (a crash, reported) instead of
swapping the machine; a load past the time limit kills the worker (a hang, reported).

Cases are deterministic: case i of seed s is always the same mutation, so a failure that
`scripts/fuzz_model_files.py --seed s` reports comes back with `--seed s --case i`.

This file is also the worker: `python3 model_file_fuzzer.py --serve` loads the model named on
each line of stdin and answers with one JSON line.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import re
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

CASE_SECONDS = 10.0  # the bound on any one load, good or bad
START_SECONDS = 120.0  # a fresh worker imports torch and loads every seed once before the limit applies
MEMORY_HEADROOM = 1 << 30  # address space a load may add to the warmed-up worker: the tiny seeds need ~10 MiB
PROBE_TEXT = "Hello, world! 123 é <|im_end|>"

KINDS = ("gguf", "safetensors", "config.json", "tokenizer.json", "quantization_config", "tokenizer_config.json",
         "generation_config.json", "model.safetensors.index.json")

# Values no header field should hold unchecked: out of every range, of every JSON type.
ABSURD_JSON = [0, -1, 1, 2, 2**31, 2**32, 2**53 + 1, 2**63, 2**64, -2**63, 10**30, 1e308, math.nan, math.inf,
               -math.inf, 0.5, -0.5, "", "x", "\u0000", "a" * 10000, None, True, False, [], {}, [None], {"": None},
               [[[0]]], "__DEEP__"]
DEEP_NESTING = 100_000  # "__DEEP__" becomes this many nested lists: deeper than any recursive parser's stack
SAFETENSORS_DTYPES = ["F32", "F16", "BF16", "F64", "I32", "I64", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL",
                      "F8_E4M3", "F8_E5M2", "Q4", "", 7, None]


@dataclass(frozen=True)
class Seeds:
    """The good models every case starts from."""

    gguf: Path  # a tiny Llama GGUF: Q8_0 matrices, F32 norms, a GPT-2 style vocabulary
    folder: Path  # a tiny Hugging Face Llama folder
    converted: Path  # that folder after `qrun convert`

    def models(self) -> list[Path]:
        return [self.gguf, self.folder, self.converted]


def make_seeds(root: Path, folder: Path) -> Seeds:
    """Seeds under `root` from the tiny Hugging Face `folder` (tests/conftest.py's make_tiny_checkpoint)."""
    from qrun.convert.main import convert
    from tiny_gguf import tiny_hf_tensors, write_gguf

    root.mkdir(parents=True, exist_ok=True)
    gguf_path = root / "tiny.gguf"
    write_gguf(gguf_path, "llama", tiny_hf_tensors(), quant=True)
    calib = root / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    converted = root / "converted"
    convert(folder, converted, bits=4.0, head_bits=8, calib=[calib], preset="fast", calib_rows=4, calib_len=64)
    return Seeds(gguf_path, folder, converted)


@dataclass(frozen=True)
class Case:
    index: int
    kind: str
    mutation: str  # what was done, in words
    model: Path  # what to load
    file: Path  # the mutated file, which an error must name


def make_case(seeds: Seeds, seed: int, index: int, workdir: Path) -> Case:
    """Case `index` of `seed`: a copy of a seed model with one file mutated, under `workdir`."""
    rng = random.Random(f"{seed}/{index}")
    kind = KINDS[index % len(KINDS)]
    where = workdir / f"case-{index}"
    if kind == "gguf":
        model = where / seeds.gguf.name
        where.mkdir(parents=True)
        target = model
        data = seeds.gguf.read_bytes()
        data, mutation = _mutate_gguf(data, rng, _gguf_layout(seeds.gguf))
    else:
        converted = kind in ("quantization_config", "model.safetensors.index.json") or \
            (kind == "safetensors" and rng.random() < 0.5)
        source = seeds.converted if converted else seeds.folder
        model = where / source.name
        shutil.copytree(source, model)
        if kind == "safetensors":
            target = rng.choice(sorted(model.glob("*.safetensors")))
            data, mutation = _mutate_safetensors(target.read_bytes(), rng)
        else:
            target = model / ("config.json" if kind == "quantization_config" else kind)
            under = ("quantization_config",) if kind == "quantization_config" else ()
            data, mutation = _mutate_json(target.read_bytes(), rng, under)
    target.write_bytes(data)
    return Case(index, kind, f"{kind}: {mutation}", model, target)


# --------------------------------------------------------------------------- byte-level mutations

def _truncate(data: bytes, rng: random.Random, header_end: int) -> tuple[bytes, str]:
    cut = rng.randrange(header_end) if rng.random() < 0.5 else rng.randrange(len(data))
    return data[:cut], f"truncated at byte {cut} of {len(data)}"


def _flip(data: bytes, rng: random.Random, header_end: int) -> tuple[bytes, str]:
    out = bytearray(data)
    spots = sorted(rng.randrange(header_end) for _ in range(rng.randint(1, 8)))
    for spot in spots:
        out[spot] ^= rng.randrange(1, 256)
    return bytes(out), f"flipped bytes at {spots}"


def _put_uint(data: bytearray, offset: int, width: int, value: int) -> None:
    data[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")


def _non_finite(rng: random.Random) -> float:
    return rng.choice([math.nan, math.inf, -math.inf])


# --------------------------------------------------------------------------- GGUF

@dataclass(frozen=True)
class _Slot:
    """One field of a GGUF header: where it is, its numpy type, what it means."""

    offset: int
    dtype: np.dtype
    role: str  # count, length, value_type, value, n_dims, dim, ggml_type, tensor_offset
    name: str


@dataclass(frozen=True)
class _GGUFLayout:
    slots: list[_Slot]
    data_start: int  # where tensor data begins (the header ends)
    tensors: list[tuple[str, int, int, int]]  # (name, ggml type, absolute offset, bytes)
    relative_offsets: list[int]


_LAYOUTS: dict[Path, _GGUFLayout] = {}


def _gguf_layout(path: Path) -> _GGUFLayout:
    """Every integer and scalar field of the seed GGUF's header, located with gguf's own reader."""
    if path in _LAYOUTS:
        return _LAYOUTS[path]
    import gguf

    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data

    def at(part: np.ndarray, index: int = 0) -> int:
        return part.ctypes.data - base + index * part.dtype.itemsize

    slots = []
    for name, f in reader.fields.items():
        if name == "GGUF.version":
            continue
        if name in ("GGUF.tensor_count", "GGUF.kv_count"):
            slots.append(_Slot(at(f.parts[0]), f.parts[0].dtype, "count", name))
            continue
        slots.append(_Slot(at(f.parts[0]), f.parts[0].dtype, "length", f"key length of {name}"))
        slots.append(_Slot(at(f.parts[2]), f.parts[2].dtype, "value_type", f"type of {name}"))
        values = f.parts[3:]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            slots.append(_Slot(at(values[0]), values[0].dtype, "value_type", f"item type of {name}"))
            slots.append(_Slot(at(values[1]), values[1].dtype, "count", f"length of {name}"))
            items = values[2:]
        else:
            items = values
        for i, part in enumerate(items[:64]):  # a vocabulary's first entries stand for the rest
            if f.types[-1] == gguf.GGUFValueType.STRING:
                if part.dtype == np.uint64:
                    slots.append(_Slot(at(part), part.dtype, "length", f"string length in {name}[{i // 2}]"))
            else:
                slots.append(_Slot(at(part), part.dtype, "value", f"{name}[{i}]"))
    for t in reader.tensors:
        name_len, _, n_dims, dims, ggml_type, offset = t.field.parts
        slots.append(_Slot(at(name_len), name_len.dtype, "length", f"name length of {t.name}"))
        slots.append(_Slot(at(n_dims), n_dims.dtype, "n_dims", f"dimension count of {t.name}"))
        slots += [_Slot(at(dims, i), dims.dtype, "dim", f"dimension {i} of {t.name}") for i in range(len(dims))]
        slots.append(_Slot(at(ggml_type), ggml_type.dtype, "ggml_type", f"type of {t.name}"))
        slots.append(_Slot(at(offset), offset.dtype, "tensor_offset", f"offset of {t.name}"))
    tensors = [(t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors]
    layout = _GGUFLayout(slots, int(reader.data_offset), tensors,
                         [start - int(reader.data_offset) for _, _, start, _ in tensors])
    _LAYOUTS[path] = layout
    return layout


def _slot_values(slot: _Slot, current: Any, layout: _GGUFLayout, size: int, rng: random.Random) -> list:
    if slot.role in ("count", "length"):
        return [0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, size, size + 1, current + 1, current - 1,
                current * 2, current * 1000, rng.randrange(2**64)]
    if slot.role == "n_dims":
        return [0, 1, 3, 4, 5, 8, 2**31, 2**32 - 1]
    if slot.role == "dim":
        return [0, 1, current + 1, current - 1, current * 2, 2**31, 2**32, 2**40, 2**63, 2**64 - 1, -1]
    if slot.role == "ggml_type":
        return list(range(42)) + [99, 2**31, 2**32 - 1]
    if slot.role == "value_type":
        return list(range(14)) + [99, 2**32 - 1]
    if slot.role == "tensor_offset":
        data = size - layout.data_start
        return layout.relative_offsets + [current + 1, current + 32, data, data + 32, 2**63, 2**64 - 32]
    if slot.dtype.kind == "f":
        return [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e30]
    if slot.dtype.kind == "b" or slot.dtype.itemsize == 1:
        return [0, 1, 2, 255]
    return [0, 1, -1, 2**31 - 1, 2**32 - 1, 2**63 - 1, current * 2, current + 1, current - 1]


def _set_slot(data: bytearray, slot: _Slot, value: int | float) -> None:
    if slot.dtype.kind == "f":
        data[slot.offset:slot.offset + slot.dtype.itemsize] = np.array([value], slot.dtype).tobytes()
    else:
        _put_uint(data, slot.offset, slot.dtype.itemsize, int(value))


def with_gguf_field(source: Path, name: str, value: int | float, target: Path) -> Path:
    """A copy of GGUF `source` at `target` with one header field set to `value`; `name` as the
    fuzzer reports fields: "length of tokenizer.ggml.token_type", "offset of output.weight", ..."""
    data = bytearray(source.read_bytes())
    _set_slot(data, next(s for s in _gguf_layout(source).slots if s.name == name), value)
    target.write_bytes(data)
    return target


def _mutate_gguf(data: bytes, rng: random.Random, layout: _GGUFLayout) -> tuple[bytes, str]:
    op = rng.choice(["truncate", "flip", "field", "field", "field", "non_finite"])
    if op == "truncate":
        return _truncate(data, rng, layout.data_start)
    if op == "flip":
        return _flip(data, rng, layout.data_start)
    out = bytearray(data)
    if op == "field":
        role = rng.choice(sorted({s.role for s in layout.slots}))
        slot = rng.choice([s for s in layout.slots if s.role == role])
        current = np.frombuffer(data, slot.dtype, 1, slot.offset)[0].item()
        value = rng.choice([v for v in _slot_values(slot, current, layout, len(data), rng) if v != current])
        _set_slot(out, slot, value)
        return bytes(out), f"set {slot.name} from {current} to {value}"
    name, ggml_type, start, n_bytes = rng.choice(layout.tensors)
    value = _non_finite(rng)
    if ggml_type == 0:  # F32
        spot = start + 4 * rng.randrange(n_bytes // 4)
        out[spot:spot + 4] = np.array([value], np.float32).tobytes()
    else:  # Q8_0: blocks of a float16 scale and 32 int8 codes
        spot = start + 34 * rng.randrange(n_bytes // 34)
        out[spot:spot + 2] = np.array([value], np.float16).tobytes()
    return bytes(out), f"wrote {value} into the weights of {name}"


# --------------------------------------------------------------------------- safetensors

def _mutate_safetensors(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    (length,) = struct.unpack("<Q", data[:8])
    header_end = 8 + length
    header = json.loads(data[8:header_end])
    payload = data[header_end:]
    names = sorted(k for k in header if k != "__metadata__")
    op = rng.choice(["truncate", "flip", "length", "entry", "entry", "entry", "non_finite"])
    if op == "truncate":
        return _truncate(data, rng, header_end)
    if op == "flip":
        return _flip(data, rng, header_end)
    if op == "length":
        value = rng.choice([0, 1, 7, length - 1, length + 1, length + 8, len(data), 2**31, 2**63, 2**64 - 1])
        out = bytearray(data)
        _put_uint(out, 0, 8, value)
        return bytes(out), f"set the header length from {length} to {value}"
    name = rng.choice(names)
    entry = header[name]
    if op == "non_finite":
        floats = [n for n in names if header[n]["dtype"] in ("F32", "F16", "BF16")]
        name = rng.choice(floats)
        entry = header[name]
        start, end = entry["data_offsets"]
        width = {"F32": 4, "F16": 2, "BF16": 2}[entry["dtype"]]
        spot = start + width * rng.randrange((end - start) // width)
        value = _non_finite(rng)
        bits = np.array([value], np.float32).tobytes()
        encoded = {"F32": bits, "F16": np.array([value], np.float16).tobytes(), "BF16": bits[2:]}[entry["dtype"]]
        out = bytearray(payload)
        out[spot:spot + width] = encoded
        return data[:header_end] + bytes(out), f"wrote {value} into the weights of {name}"
    what = rng.choice(["dtype", "shape", "data_offsets", "delete", "add", "rename", "json"])
    begin, end = entry["data_offsets"]
    other = header[rng.choice(names)]
    if what == "dtype":
        entry["dtype"] = rng.choice([d for d in SAFETENSORS_DTYPES if d != entry["dtype"]])
        mutation = f"set {name}'s dtype to {entry['dtype']!r}"
    elif what == "shape":
        shape = entry["shape"]
        entry["shape"] = rng.choice([s for s in ([], [0], [-1], [2**40, 2**40], [2**63], [2**64], shape + [1],
                                                 shape[:-1], shape[::-1], [2 * x for x in shape], [0] + shape, "x",
                                                 None, [1.5]) if s != shape])
        mutation = f"set {name}'s shape to {entry['shape']!r}"
    elif what == "data_offsets":
        entry["data_offsets"] = rng.choice([o for o in ([0, 0], [end, begin], [begin, len(payload) * 2], [-1, end],
                                                        other["data_offsets"], [begin, end + 1], [begin + 1, end],
                                                        [2**64, 2**64 + 4], [begin], None) if o != [begin, end]])
        mutation = f"set {name}'s data_offsets to {entry['data_offsets']!r}"
    elif what == "delete":
        del header[name]
        mutation = f"deleted {name}"
    elif what == "add":
        new = rng.choice(["model.layers.0.self_attn.q_proj.bias", "model.bogus.weight", "lm_head.qweight",
                          "model.layers.7.mlp.up_proj.weight", ""])
        header[new] = dict(other)
        mutation = f"added {new!r} over {other['data_offsets']}"
    elif what == "rename":
        new = rng.choice([n for n in names if n != name] + ["model.layers.0.self_attn.rotary_emb.inv_freq",
                                                            "model.layers.2.mlp.up_proj.weight"])
        header = {(new if k == name else k): v for k, v in header.items()}
        mutation = f"renamed {name} to {new}"
    else:
        text, mutation = _mutate_json(json.dumps(header).encode(), rng, ())
        return _safetensors(text, payload), f"header {mutation}"
    return _safetensors(json.dumps(header, allow_nan=True).encode(), payload), mutation


def _safetensors(header: bytes, payload: bytes) -> bytes:
    header += b" " * (-len(header) % 8)  # as safetensors pads it
    return struct.pack("<Q", len(header)) + header + payload


# --------------------------------------------------------------------------- JSON

def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) inside `doc`, long lists sampled at both ends."""
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(doc, list):
        picked = range(len(doc)) if len(doc) <= 16 else [*range(8), *range(len(doc) - 8, len(doc))]
        for i in picked:
            out += _paths(doc[i], prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _mutate_json(data: bytes, rng: random.Random, under: tuple) -> tuple[bytes, str]:
    op = rng.choice(["truncate", "flip"] + ["value"] * 5 + ["delete", "rename", "swap", "grow"])
    if op == "truncate":
        return _truncate(data, rng, len(data))
    if op == "flip":
        return _flip(data, rng, len(data))
    doc = json.loads(data)
    paths = [p for p in _paths(_get(doc, under), under) if op == "value" or len(p) > len(under)]
    path = rng.choice(paths)
    place = ".".join(map(str, path)) or "the document"
    if op == "value":
        current = _get(doc, path)
        choices = list(ABSURD_JSON)
        if isinstance(current, (int, float)) and not isinstance(current, bool) and math.isfinite(current):
            choices += [current + 1, current - 1, -current, current * 2, current * 1000]
        value = rng.choice(choices)
        mutation = f"set {place} to {str(value)[:40]!r}"
        doc = _replace(doc, path, value)
    else:
        parent, last = _get(doc, path[:-1]), path[-1]
        if op == "delete":
            del parent[last]
            mutation = f"deleted {place}"
        elif op == "rename" and isinstance(parent, dict):
            new = rng.choice(sorted(map(str, parent)) + ["", "model.layers.0", "model.layers.0.input_layernorm",
                                                         "model.layers.9.mlp.up_proj", "model.embed_tokens"])
            parent[new] = parent.pop(last)
            mutation = f"renamed {place} to {new!r}"
        elif op == "grow" and isinstance(parent, list):
            parent.extend([parent[last]] * rng.choice([1, 1000]))
            mutation = f"repeated {place}"
        else:
            value = copy.deepcopy(_get(doc, rng.choice(paths)))  # a copy: the field may hold the path itself
            mutation = f"set {place} to another field's value {str(value)[:40]!r}"
            doc = _replace(doc, path, value)
    text = json.dumps(doc, allow_nan=True)
    text = text.replace('"__DEEP__"', "[" * DEEP_NESTING + "]" * DEEP_NESTING)
    return text.encode(), mutation


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


# --------------------------------------------------------------------------- the watchdog

@dataclass(frozen=True)
class Outcome:
    verdict: str  # loaded, clear error, unclear error (a QrunError not one line naming the file), crash, hang
    message: str
    seconds: float


def judge(case: Case, answer: dict, seconds: float) -> Outcome:
    """A worker's answer for `case` as a verdict: a QrunError must be one line naming the file
    (by its name: an error about a folder's config.json may give the folder's path)."""
    kind, message = answer["outcome"], answer["message"]
    if kind == "error":
        clear = "\n" not in message and case.file.name in message
        return Outcome("clear error" if clear else "unclear error", message, seconds)
    return Outcome(kind, message, seconds)


class Watchdog:
    """A worker process that loads models one at a time under a time and an address-space limit;
    a load past the time limit kills it (a hang) and the next load starts a fresh one."""

    def __init__(self, warm_up: list[Path], case_seconds: float = CASE_SECONDS):
        self.warm_up = warm_up
        self.case_seconds = case_seconds
        self._worker: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile()

    def load(self, model: Path) -> tuple[dict, float]:
        """The worker's answer for `model` ({"outcome", "message"}) and the seconds it took."""
        if self._worker is None:
            self._start()
        start = time.perf_counter()
        try:
            self._worker.stdin.write(f"{model}\n")
            self._worker.stdin.flush()
            answer = self._answer(self.case_seconds)
        except (BrokenPipeError, OSError):
            answer = None
        seconds = time.perf_counter() - start
        if answer is None:
            timed_out = self._worker.poll() is None
            self._stop()
            if timed_out:
                return {"outcome": "hang", "message": f"no answer within {self.case_seconds:.0f} s"}, seconds
            return {"outcome": "crash", "message": f"worker died: {self._log_tail()}"}, seconds
        return answer, seconds

    def close(self) -> None:
        self._stop()
        self._log.close()

    def __enter__(self) -> "Watchdog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self._log.seek(0)
        self._log.truncate()
        env = dict(os.environ, OMP_NUM_THREADS="1", QRUN_THREADS="1")
        self._worker = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(MEMORY_HEADROOM), *map(str, self.warm_up)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        ready = self._answer(START_SECONDS)
        if ready is None or ready.get("outcome") != "ready":
            self._stop()
            raise RuntimeError(f"the fuzzing worker did not start: {ready or self._log_tail()}")

    def _answer(self, seconds: float) -> dict | None:
        readable, _, _ = select.select([self._worker.stdout], [], [], seconds)
        line = self._worker.stdout.readline() if readable else ""
        return json.loads(line) if line else None

    def _stop(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker.wait()
            self._worker = None

    def _log_tail(self) -> str:
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "no output"


def _serve(headroom: int, warm_up: list[str]) -> None:
    """The worker: answer each model path on stdin with one JSON line on the real stdout."""
    import resource
    import traceback

    import torch

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to the log, not into the answers
    torch.set_num_threads(1)
    from qrun.errors import QrunError
    from qrun.loader import load_model

    def load(model: str) -> dict:
        try:
            loaded = load_model(model, dtype="float32", device="cpu")
            ids = loaded.tokenizer.encode(PROBE_TEXT)
            loaded.tokenizer.decode(ids)
            return {"outcome": "loaded", "message": ""}
        except QrunError as err:
            return {"outcome": "error", "message": str(err)}
        except BaseException as err:  # noqa: BLE001 - anything else is what the fuzzer looks for
            frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
            where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
            return {"outcome": "crash", "message": f"{type(err).__name__}{where}: {str(err)[:300]}"}

    for model in warm_up:
        answer = load(model)
        if answer["outcome"] != "loaded":
            print(json.dumps({"outcome": "seed failed", "message": f"{model}: {answer['message']}"}), file=answers,
                  flush=True)
            return
    used = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))
    print(json.dumps({"outcome": "ready", "message": ""}), file=answers, flush=True)
    for line in sys.stdin:
        print(json.dumps(load(line.strip())), file=answers, flush=True)


# --------------------------------------------------------------------------- a run

@dataclass
class Report:
    """What a run of cases found."""

    outcomes: list[tuple[Case, Outcome]] = field(default_factory=list)

    def add(self, case: Case, outcome: Outcome) -> None:
        self.outcomes.append((case, outcome))

    def counts(self) -> Counter:
        return Counter(outcome.verdict for _, outcome in self.outcomes)

    def failures(self) -> list[tuple[Case, Outcome]]:
        """Cases that neither loaded nor ended in a clear error in time."""
        return [(c, o) for c, o in self.outcomes
                if o.verdict not in ("loaded", "clear error") or o.seconds > CASE_SECONDS]

    def distinct_errors(self) -> Counter:
        """Clear errors with paths, numbers and quoted names blanked, so one problem counts once."""
        return Counter(normalize(o.message, c.model) for c, o in self.outcomes if o.verdict == "clear error")

    def slowest(self) -> float:
        return max((o.seconds for _, o in self.outcomes), default=0.0)


def normalize(message: str, model: Path) -> str:
    text = message.replace(str(model), "<model>")
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:160]


def run_cases(seeds: Seeds, seed: int, indices: list[int], workdir: Path, watchdog: Watchdog,
              on_case: Callable[[Case, Outcome], None] | None = None) -> Report:
    """Make and load each case; each case's files are removed once it is judged."""
    report = Report()
    for index in indices:
        case = make_case(seeds, seed, index, workdir)
        answer, seconds = watchdog.load(case.model)
        outcome = judge(case, answer, seconds)
        report.add(case, outcome)
        if on_case:
            on_case(case, outcome)
        shutil.rmtree(workdir / f"case-{index}", ignore_errors=True)
    return report


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    _serve(int(sys.argv[2]), sys.argv[3:])
