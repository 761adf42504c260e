"""The `qrun` command line: generate, chat, info, and the subcommands other modules provide."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qrun.errors import QrunError
from qrun.options import (add_engine_arguments, add_sampling_arguments, engine_args_from, load_llm, parse_memory,
                          sampling_fields_from, sampling_params_from)
from qrun.replicas import ReplicaSpec, add_replica_arguments
from qrun.sampling_params import SamplingParams

if TYPE_CHECKING:
    from qrun.llm import LLM


# -- shared by the commands --------------------------------------------------------------------
def _model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder, .gguf file, alias (smollm2-135m) or hub id (owner/name)")


# -- generate ----------------------------------------------------------------------------------
GENERATE_EPILOG = """\
examples:
  qrun generate smollm2-135m "The capital of France is" --max-tokens 8 --temperature 0
  qrun generate smollm2-135m "Write a haiku about rain" --chat --temperature 0.7
  qrun generate smollm2-135m --input qrun/data/sample_prompts.jsonl --output answers.jsonl
  qrun generate smollm2-135m --input requests.jsonl --output answers.jsonl --replicas 4 --ray-address auto

--input lines are JSON objects: {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]},
optionally with "id" and sampling fields ("max_tokens", "temperature", "stop", ...) that override the flags.
Outputs are JSON lines in input order: {"line", "id", "text", "token_ids", "finish_reason", "stop_string",
"stop_token_id", "prompt_tokens", "completion_tokens", "cached_tokens"}, or {"line", "error"} for a skipped line."""


def run_generate(args: argparse.Namespace) -> None:
    if (args.prompt is None) == (args.input is None):
        raise UsageError("give either a PROMPT or --input FILE.jsonl")
    if args.output and args.input is None:
        raise UsageError("--output needs --input; a single prompt streams to stdout")
    replicas = ReplicaSpec.from_args(args)
    if replicas.on_ray and args.input is None:
        raise UsageError("--replicas and --ray-address run an --input batch; a single prompt runs here")
    replicas.check_ray_installed()
    base = sampling_params_from(args)  # validates the flags before the slow model load
    if args.input is not None:
        _generate_batch(args, replicas)
    else:
        _generate_one(load_llm(args.model, engine_args_from(args)), args.prompt, base, args.chat)


def _generate_one(llm: "LLM", prompt: str, params: SamplingParams, chat: bool) -> None:
    import sys
    import time

    from qrun.chat import stats_line

    ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else prompt
    start, shown, output = time.perf_counter(), 0, None
    for output in llm.stream_outputs(ids, params):
        sys.stdout.write(output.text[shown:])
        sys.stdout.flush()
        shown = len(output.text)
    sys.stdout.write("\n")
    print(f"{stats_line(output, time.perf_counter() - start)}, finish: {output.finish_reason}", file=sys.stderr)


def _generate_batch(args: argparse.Namespace, replicas: ReplicaSpec) -> None:
    import sys
    import time

    from qrun.batch_requests import BatchDefaults, RefusedRequest, answer_requests, parse_request_line

    path = Path(args.input)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise QrunError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    records: list[dict[str, Any]] = []  # one per non-blank line, in input order
    queued: list[tuple[int, dict[str, Any]]] = []  # (index in records, request)
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        record: dict[str, Any] = {"line": number}
        try:
            request = parse_request_line(text)
        except ValueError as err:
            _refuse(path, record, str(err), args.strict)
        else:
            if request.get("id") is not None:
                record["id"] = request["id"]
            queued.append((len(records), request))
        records.append(record)
    if not queued:
        raise QrunError(f"{path} has no valid requests")
    requests = [request for _, request in queued]
    defaults = BatchDefaults(sampling_fields_from(args), args.chat)
    if replicas.on_ray:
        from qrun.ray_batch import answer_on_ray

        start = time.perf_counter()
        answers = answer_on_ray(args.model, engine_args_from(args), requests, defaults, replicas)
        where = f" on {replicas.count} replicas (starting them included)"
    else:
        llm = load_llm(args.model, engine_args_from(args))
        start = time.perf_counter()
        try:
            answers = answer_requests(llm, requests, defaults, strict=args.strict, progress=True)
        except RefusedRequest as err:  # --strict: before generating anything
            _refuse(path, records[queued[err.index][0]], str(err), strict=True)
        where = ""
    elapsed = time.perf_counter() - start
    for (index, _), answer in zip(queued, answers):
        if "error" in answer:
            _refuse(path, records[index], answer["error"], args.strict)
        else:
            records[index].update(answer)
    _write_jsonl(records, args.output)
    answered = [a for a in answers if "error" not in a]
    generated = sum(a["completion_tokens"] for a in answered)
    prompt_tokens = sum(a["prompt_tokens"] for a in answered)
    skipped = len(records) - len(answered)
    print(f"{len(answered)} requests{f' ({skipped} skipped)' if skipped else ''}, {prompt_tokens} prompt tokens, "
          f"{generated} generated tokens in {elapsed:.1f} s{where}: {generated / max(elapsed, 1e-9):.1f} tokens/s",
          file=sys.stderr)


def _refuse(path: Path, record: dict[str, Any], reason: str, strict: bool) -> None:
    """A line that cannot run: the error with --strict, else skipped with a note on stderr."""
    import sys

    message = f"{path}:{record['line']}: {reason}"
    if strict:
        raise QrunError(f"{message} (--strict stops at the first bad line)")
    print(f"qrun: skipping {message}", file=sys.stderr)
    record["error"] = reason


def _write_jsonl(records: list[dict[str, Any]], output: str | None) -> None:
    """To stdout, or to `output` via a temporary file renamed into place (never half-written)."""
    import sys

    from qrun.atomic import atomic_write_text

    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if output is None:
        sys.stdout.write(text)
        return
    target = Path(output)
    try:
        atomic_write_text(target, text)
    except OSError as err:
        raise QrunError(f"cannot write {target}: {err.strerror}") from None


# -- info --------------------------------------------------------------------------------------
INFO_EPILOG = """\
examples:
  qrun info smollm2-135m
  qrun info ./my-model-q4 --kv-cache-memory 2GiB --block-size 32
  qrun info smollm2-135m --gpu-memory 8GiB                # what fits on an 8 GiB card
  qrun info ./llama-3-8b --gpu rtx4090 --bits 4.0         # config.json alone is enough"""


def run_info(args: argparse.Namespace) -> None:
    if args.gpu_memory is not None or args.gpu is not None:
        return run_info_plan(args)
    from rich.console import Console
    from rich.table import Column, Table

    from qrun.llm_engine import EngineConfig, cache_budget
    from qrun.loader import load_model
    from qrun.kv_cache import KVCacheSpec
    from qrun.huge_pages import resident_bytes
    from qrun.memory_plan import kv_blocks
    from qrun.quant import QuantLinear

    if args.bits is not None or args.head_bits is not None:
        raise UsageError("--bits and --head-bits plan a quantized model on a card: give --gpu-memory or --gpu too")
    config = EngineConfig(model=args.model, **engine_args_from(args))
    with Console(stderr=True).status(f"loading {args.model}"):
        # Unfused, every checkpoint linear stays a module of its own to count and list.
        loaded = load_model(config.model, dtype=config.dtype, device=config.device, fuse_projections=False)
    model, mc = loaded.model, loaded.config
    # Quantized layers store packed integers: count their logical weights and actual bits.
    params = bits = 0.0
    quantized: list[tuple[str, QuantLinear]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            quantized.append((name, module))
            weights = module.in_features * module.out_features
            params += weights
            bits += weights * module.layout.bpw()
            seen.update(id(p) for n, p in module.named_parameters() if n != "bias")
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))  # a tied head shares the embedding: count it once
            params += p.numel()
            bits += p.numel() * p.element_size() * 8
    max_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
    budget = cache_budget(config.kv_cache_memory, loaded.device)
    cache = KVCacheSpec.parse(config.kv_cache_dtype, loaded.dtype, loaded.kv_dtype)
    kv_tokens = config.block_size * kv_blocks(budget, mc, cache, config.block_size, config.max_num_seqs, max_len)

    console = Console(highlight=False)
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("model", f"{args.model} ({loaded.source.kind}: {loaded.source.path})")
    _architecture_rows(table, mc, max_len)
    table.add_row("parameters", f"{params / 1e6:,.1f} M")
    table.add_row("dtype", f"{str(loaded.dtype).removeprefix('torch.')} on {loaded.device}")
    table.add_row("weights", f"{_size(bits / 8)}, {bits / max(params, 1):.2f} bits per weight; "
                  f"held as {_size(resident_bytes(model))} on {loaded.device} (kernel layouts and copies included)")
    table.add_row("KV cache", f"{kv_tokens:,} tokens ({cache.name}) in {_size(budget)} "
                  f"({_size(cache.bytes_per_token(mc))} per token, block {config.block_size}; "
                  f"at most {config.max_num_seqs} sequences x {max_len} tokens)")
    qconfig = loaded.hf_config.get("quantization_config")
    if isinstance(qconfig, dict):
        scalars = ", ".join(f"{k}={v}" for k, v in qconfig.items() if isinstance(v, (str, int, float, bool)))
        table.add_row("quantization", scalars or "(no scalar settings)")
    console.print(table)
    if quantized:
        # the other columns wrap first; a layer's name too, in a narrow terminal, but is never cut
        layer_column = Column("layer", min_width=max(len(name) for name, _ in quantized), overflow="fold")
        layers = Table(layer_column, "shape", "group", "bits per input group", "bpw", box=None, padding=(0, 1))
        for name, module in quantized:
            runs = ", ".join(f"{b}b x {n}" for b, n in module.layout.runs())
            layers.add_row(name, f"{module.out_features}x{module.in_features}", str(module.group_size), runs,
                           f"{module.layout.bpw():.3f}")
        console.print(layers)


def _size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} B"


def _architecture_rows(table, mc, max_len: int) -> None:
    table.add_row("architecture", f"{mc.architecture}: {mc.num_layers} layers, hidden {mc.hidden_size}, "
                  f"{mc.num_heads} heads ({mc.num_kv_heads} KV) x {mc.head_dim}, vocab {mc.vocab_size}")
    table.add_row("context", f"{max_len} tokens" + (f" (model: {mc.max_model_len})" if max_len != mc.max_model_len
                                                    else ""))


def run_info_plan(args: argparse.Namespace) -> None:
    """What fits on a card, from the model's config alone."""
    from rich.console import Console
    from rich.table import Table

    import torch

    from qrun.config import ModelConfig
    from qrun.format import DEFAULT_HEAD_BITS
    from qrun.llm_engine import EngineConfig
    from qrun.loader import read_model_config
    from qrun.memory_plan import CARDS, PLANNED_HEAD_EXTRA_BITS, plan

    card = None
    if args.gpu is not None:
        card = CARDS.get(args.gpu.lower())
        if card is None:
            raise UsageError(f"--gpu {args.gpu!r} is not a card qrun knows; known: {', '.join(CARDS)} "
                             "(or give --gpu-memory)")
    memory = args.gpu_memory if args.gpu_memory is not None else card.memory
    if not isinstance(memory, int):
        raise UsageError("--gpu-memory takes the card's size in bytes (24GiB), not a fraction")
    if args.dtype not in (None, "auto", "float16", "bfloat16"):
        raise UsageError(f"--dtype {args.dtype}: a GPU plan is for float16 or bfloat16")
    engine = EngineConfig(model=args.model, **engine_args_from(args))
    hf_config = read_model_config(args.model)
    mc = ModelConfig.from_hf(hf_config)
    qconfig = hf_config.get("quantization_config") or {}
    linear_bpw, head_bpw = args.bits, None
    if args.bits is not None:
        head_bpw = (args.head_bits or DEFAULT_HEAD_BITS) + PLANNED_HEAD_EXTRA_BITS
    elif qconfig.get("quant_method") == "qrun-exl":
        linear_bpw, head_bpw = qconfig.get("achieved_bpw"), qconfig.get("head_bpw")
    dtype = {"bfloat16": torch.bfloat16}.get(args.dtype, torch.float16)
    result = plan(mc, memory, dtype=dtype, linear_bpw=linear_bpw, head_bpw=head_bpw, block_size=engine.block_size,
                  max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                  max_model_len=engine.max_model_len, kv_cache_dtype=engine.kv_cache_dtype)
    w = result.weights
    console = Console(highlight=False)
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("model", args.model)
    _architecture_rows(table, mc, result.max_model_len)
    table.add_row("card", (f"{card.name}: {_size(memory)}, {card.bandwidth / 1e9:,.0f} GB/s" if card
                           else _size(memory)))
    weights = "dense " + str(dtype).removeprefix("torch.") if linear_bpw is None else f"layers at {linear_bpw:.2f} bpw"
    if head_bpw:
        weights += f", head at {head_bpw:.2f} bpw"
    table.add_row("weights", f"{_size(w.total)} ({weights}; embedding {_size(w.embedding)})")
    table.add_row("reserve", f"{_size(result.reserve)} (CUDA context and workspaces, and one step's activations "
                  f"at {engine.max_num_batched_tokens} tokens / {engine.max_num_seqs} sequences)")
    if not result.fits:
        table.add_row("KV cache", f"[red]does not fit[/red]: {_size(memory)} - weights - reserve leaves "
                      f"{_size(result.kv_budget)}; use fewer bits (--bits), a bigger card, or lower "
                      "--max-num-batched-tokens / --max-num-seqs")
        console.print(table)
        return
    table.add_row("KV cache", f"{result.kv_tokens:,} tokens ({result.cache.name}) in "
                  f"{_size(result.kv_budget)}, block {result.block_size}")
    lengths = sorted({n for n in (1024, 4096, result.max_model_len) if n <= result.max_model_len})
    table.add_row("concurrent sequences", ", ".join(
        f"{result.concurrent_sequences(n)} x {n} tokens" for n in lengths)
        + f" (--max-num-seqs caps at {result.max_num_seqs})")
    if card:
        table.add_row("decode roofline", ", ".join(
            f"{result.decode_tokens_per_second(card.bandwidth, n):,.0f} tok/s at {n} tokens of context"
            for n in (1, *lengths)) + " (one stream, every byte read once at the card's bandwidth)")
    console.print(table)


# -- the parser and main -----------------------------------------------------------------------
class UsageError(Exception):
    """Wrong combination of arguments: reported like argparse's own errors, exit code 2."""


# Subcommands other modules implement: (name, module, add-arguments function, run function, help).
# Each module is imported only when its subcommand is used, so `qrun generate` never pays for it.
EXTERNAL_COMMANDS = (
    ("convert", "qrun.convert.main", "add_convert_arguments", "run_convert", "quantize a model to mixed-bit weights"),
    ("ppl", "qrun.perplexity", "add_ppl_arguments", "run_ppl", "measure perplexity on a text"),
    ("serve", "qrun.server", "add_serve_arguments", "run_serve", "serve an OpenAI-compatible HTTP API"),
    ("bench", "qrun.bench", "add_bench_arguments", "run_bench", "measure serving throughput and latency on a workload"),
)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The full parser; an external subcommand's module is imported only if argv invokes it."""
    import importlib
    from importlib.metadata import version

    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's unset --debug must not overwrite `qrun --debug CMD`.
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and engine logs")
    parser = argparse.ArgumentParser(
        prog="qrun", description="Quantized LLM inference: paged KV cache, continuous batching.",
        epilog='example: qrun generate smollm2-135m "The capital of France is" --max-tokens 8 --temperature 0',
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks and engine logs")
    parser.add_argument("--version", action="version", version=f"qrun {version('qrun')}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, epilog: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help_text, description=help_text, epilog=epilog, parents=[common],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)

    gen = add("generate", "generate text for one prompt (streamed) or a JSONL batch", GENERATE_EPILOG)
    _model_argument(gen)
    gen.add_argument("prompt", nargs="?", help="the prompt; its completion streams to stdout")
    gen.add_argument("--input", metavar="FILE.jsonl", help="run a batch of requests, one JSON object per line")
    gen.add_argument("--output", metavar="FILE.jsonl", help="write the batch outputs here instead of stdout")
    gen.add_argument("--strict", action="store_true", help="fail on a malformed --input line instead of skipping it "
                     "(with --replicas, after the run: the replicas check the lines against the model)")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    gen.set_defaults(run=run_generate)
    add_sampling_arguments(gen)
    add_engine_arguments(gen)
    add_replica_arguments(gen)

    from qrun.chat import run_chat

    chat = add("chat", "chat with a model in the terminal", CHAT_EPILOG)
    _model_argument(chat)
    chat.add_argument("--system", metavar="TEXT", help="system prompt")
    chat.add_argument("--chat-template", metavar="FILE", help="a jinja2 chat template to use instead of the model's")
    chat.set_defaults(run=run_chat, max_tokens=512)
    add_sampling_arguments(chat)
    add_engine_arguments(chat)

    info = add("info", "show a model's architecture, size, quantization and KV cache capacity", INFO_EPILOG)
    _model_argument(info)
    card = info.add_argument_group("what fits on a GPU (reads config.json only)")
    card.add_argument("--gpu-memory", type=parse_memory, metavar="SIZE", help="the card's memory (24GiB)")
    card.add_argument("--gpu", metavar="CARD", help="a known card, for its memory and bandwidth (rtx4090, a100-80gb, ...)")
    card.add_argument("--bits", type=float, help="plan the model converted to this many bits per weight")
    card.add_argument("--head-bits", type=int, help="with --bits: the converted head's bits (qrun convert's default)")
    info.set_defaults(run=run_info)
    add_engine_arguments(info)

    invoked = next((a for a in argv if not a.startswith("-")), None)
    for name, module_name, add_name, run_name, help_text in EXTERNAL_COMMANDS:
        if not _module_exists(module_name):
            continue
        sub = add(name, help_text, "")
        if name == invoked:
            module = importlib.import_module(module_name)
            getattr(module, add_name)(sub)
            sub.set_defaults(run=getattr(module, run_name))
    return parser


def _module_exists(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


CHAT_EPILOG = """\
examples:
  qrun chat smollm2-135m
  qrun chat smollm2-135m --system "Answer in one sentence." --temperature 0.7
  qrun chat ./my-model --chat-template template.jinja

in the chat: /help, /reset, /system TEXT, /set temperature=0.7 top_p=0.9, /save FILE, /load FILE, /quit.
Ctrl-C stops an answer; Ctrl-D exits."""


def main(argv: list[str] | None = None) -> int:
    import logging
    import sys

    import rich

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    # Progress bars and spinners (rich's global console) go to stderr; stdout carries only data.
    rich.reconfigure(stderr=True)
    if args.debug:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        args.run(args)
    except UsageError as err:
        print(f"qrun {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (QrunError, ValueError) as err:
        if args.debug:
            raise
        print(f"qrun: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("qrun: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
