"""The command-line options every command shares, in one place: the engine flags (declared,
parsed, turned into EngineConfig keyword arguments) and the sampling flags (into SamplingParams),
for generate, chat, bench, serve, ppl and info.

Imports neither torch nor the engine at module level, so `qrun --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qrun.config import KV_CACHE_DTYPES
from qrun.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from qrun.llm import LLM

# Decimal and binary size suffixes accepted by --kv-cache-memory (case-insensitive).
_MEMORY_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
                 "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

# The SamplingParams fields a command line (or a JSONL batch line) may set.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "stop", "seed", "ignore_eos")
ENGINE_FIELDS = ("dtype", "device", "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                 "enable_prefix_caching", "max_model_len", "num_scheduler_steps", "enforce_eager")


def parse_memory(text: str) -> int | float:
    """'2GiB' / '500MB' / '1073741824' -> bytes (int); '0.2' -> a fraction of free memory (float)."""
    match = _MEMORY_RE.match(text)
    if not match or match.group(2).lower() not in _MEMORY_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size: give bytes with a unit (2GiB, 500MB) or a fraction like 0.2")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit and number <= 1:
        if number <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a fraction must be in (0, 1]")
        return number
    return int(number * _MEMORY_UNITS[unit])


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Sampling flags; unset flags stay None so SamplingParams (or a JSONL line) decides."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, help="most tokens to generate per request")
    group.add_argument("--temperature", type=float, help="0 is greedy (default 1.0)")
    group.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    group.add_argument("--top-k", type=int, help="sample from the k likeliest tokens (-1: all)")
    group.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability")
    group.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeating tokens")
    group.add_argument("--presence-penalty", type=float, help="in [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, help="in [-2, 2]")
    group.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    group.add_argument("--seed", type=int, help="seed for reproducible sampling")
    group.add_argument("--ignore-eos", action="store_true", default=None,
                       help="keep generating past the end-of-sequence token")
    constrain = group.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", type=_json_file, metavar="FILE",
                           help="output JSON that validates against the JSON schema in FILE")
    constrain.add_argument("--regex", metavar="PATTERN", help="output text matching this regular expression")
    constrain.add_argument("--choice", action="append", metavar="TEXT",
                           help="output exactly one of these texts (repeatable)")


def _json_file(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise argparse.ArgumentTypeError(f"{path} is not a JSON file: {err}") from None


def sampling_fields_from(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags the user actually set, as SamplingParams keyword arguments."""
    fields = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name, None) is not None}
    constraint = {name: getattr(args, flag) for name, flag in (("json", "json_schema"), ("regex", "regex"),
                                                               ("choice", "choice"))
                  if getattr(args, flag, None) is not None}
    if constraint:
        fields["structured_outputs"] = StructuredOutputsParams(**constraint)
    return fields


def sampling_params_from(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    """SamplingParams from the flags; `overrides` (e.g. a JSONL line's fields) win over flags."""
    return SamplingParams(**{**sampling_fields_from(args), **overrides})


def add_placement_arguments(parser) -> None:
    """--dtype and --device (unset: None, meaning auto), for commands that load a model."""
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                        help="compute dtype (auto: bfloat16 on GPU and on CPUs with native bfloat16, else float32 "
                             "with dense linears' weights rounded to float16)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where to run (auto: cuda if present)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="how the KV cache stores keys and values (auto: the compute dtype, float16 beside "
                             "float32 on a CPU without native bfloat16); int8 holds 1.9x and int4 3.2x the tokens of a "
                             "16-bit cache")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags; unset flags stay None so EngineConfig's defaults apply."""
    group = parser.add_argument_group("engine")
    add_placement_arguments(group)
    group.add_argument("--max-num-seqs", type=int, help="most sequences in one batch")
    group.add_argument("--max-num-batched-tokens", type=int, help="token budget of one forward pass")
    group.add_argument("--block-size", type=int, help="tokens per KV cache block (a power of two)")
    group.add_argument("--kv-cache-memory", type=parse_memory, metavar="SIZE",
                       help="KV cache budget: bytes (2GiB, 500MB) or a fraction of free memory (0.2)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                       help="do not reuse the KV blocks of shared prompt prefixes")
    group.add_argument("--max-model-len", type=int, help="cap the context length (tokens)")
    group.add_argument("--num-scheduler-steps", type=int,
                       help="decode steps the CPU model runs back to back before the engine's bookkeeping "
                            "(default 16, fewer where they would take over 50 ms; 1: after every token)")
    group.add_argument("--enforce-eager", action="store_true", default=None,
                       help="run every step in eager mode: no torch.compile of CPU decode steps")


def engine_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user set, as EngineConfig keyword arguments (model excluded)."""
    return {name: getattr(args, name) for name in ENGINE_FIELDS if getattr(args, name, None) is not None}


def load_llm(model: str, engine_args: dict[str, Any]) -> "LLM":
    """Load with a spinner on stderr, since the first use of a model may download it."""
    from rich.console import Console

    from qrun.llm import LLM

    with Console(stderr=True).status(f"loading {model}"):
        return LLM(model, **engine_args)
