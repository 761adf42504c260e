"""The engine: requests in, one scheduled forward pass per step, outputs out."""

from __future__ import annotations

import gc
import itertools
import logging
import operator
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence as Seq

import torch

from qrun.block_manager import BlockManager
from qrun.config import KV_CACHE_DTYPES
from qrun.cpu_threads import CpuThreads
from qrun.errors import QrunError, RequestError
from qrun.heap import bound_matmul_caches
from qrun.loader import load_model
from qrun.kv_cache import KVCacheSpec
from qrun.memory_plan import kv_blocks
from qrun.model_runner import ModelRunner
from qrun.sampler import sample, samples_in_runs
from qrun.sampling_params import SamplingParams
from qrun.scheduler import ScheduledBatch, Scheduler
from qrun.sequence import RequestMetrics, RequestOutput, Sequence
from qrun.structured_outputs import GrammarCompiler, Matcher
from qrun.tokenizer import IncrementalDetokenizer

log = logging.getLogger("qrun")

# What a request's prompt may be: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}.
Prompt = str | Seq[int] | dict[str, Any]

# Without an explicit budget the cache takes this share of the memory left after the weights.
DEFAULT_KV_FRACTION = {"cuda": 0.9, "cpu": 0.1}
# The longest run of back-to-back decode steps (EngineConfig.num_scheduler_steps), timed by the
# last decode step: a streamed request's tokens then arrive at least ~20 times a second, and the
# engine's bookkeeping of a step (~0.2 ms on a 2-core Xeon) is skipped where it matters, beside
# steps of a few ms (one or a few sequences), not beside long ones (a large batch's).
MAX_DECODE_RUN_S = 0.05


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_memory: int | float | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    # Decode steps the C++ model may run back to back without returning to the engine (vLLM's
    # multi-step scheduling): 1 returns after every token. Streamed tokens then arrive up to this
    # many at a time; see LLMEngine._decode_steps for when a step qualifies.
    num_scheduler_steps: int = 16
    # Eager mode only: no torch.compile of CPU decode steps, no CUDA graphs on a GPU
    # (QRUN_ENFORCE_EAGER=1 sets the default).
    enforce_eager: bool = field(default_factory=lambda: os.environ.get("QRUN_ENFORCE_EAGER", "0") == "1")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                f"{self.max_num_seqs}, or running sequences could not all decode in one step"
            )
        memory = self.kv_cache_memory
        if memory is not None and not (isinstance(memory, int) and memory > 1 or
                                       isinstance(memory, float) and 0 < memory <= 1):
            raise ValueError(f"kv_cache_memory={memory!r} must be a byte count (int > 1) or a fraction in (0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache now: free device memory, or the host's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise QrunError("cannot read available memory from /proc/meminfo; pass kv_cache_memory in bytes")


def cache_budget(kv_cache_memory: int | float | None, device: torch.device) -> int:
    """The KV cache's bytes: `kv_cache_memory` bytes, or that fraction (by default the device's
    DEFAULT_KV_FRACTION) of the memory free now."""
    if isinstance(kv_cache_memory, int):
        return kv_cache_memory
    fraction = kv_cache_memory if kv_cache_memory is not None else DEFAULT_KV_FRACTION.get(device.type, 0.1)
    return int(available_memory(device) * fraction)


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, for observers (`LLMEngine.step_observers`): benchmarks, metrics."""

    scheduled_tokens: int  # tokens in the forward passes
    prefill_tokens: int  # of them, prompt tokens (chunked prefill counts each chunk)
    num_running: int  # sequences running after the step
    live_tokens: int  # tokens the running sequences hold in the KV cache
    partial_blocks: int  # Σ ceil(live tokens / block size) over running sequences: blocks they must hold
    used_blocks: int  # KV blocks allocated after the step (shared prefix blocks once)
    forward_passes: int = 1  # more where decode steps ran back to back (EngineConfig.num_scheduler_steps)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    matcher: Matcher | None = None  # its grammar before any output: each completion starts from a copy
    error: str | None = None  # why the engine failed it (LLMEngine._fail)

    @property
    def finished(self) -> bool:
        # A request failed before its prompt was done never forks its other completions.
        return (self.error is not None or len(self.seqs) == self.params.n) and all(s.finished for s in self.seqs)

    def output(self) -> RequestOutput:
        first = self.seqs[0]
        metrics = RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=first.first_token_time,
            finish_time=max((s.finish_time for s in self.seqs if s.finish_time), default=None)
            if self.finished else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=first.num_cached_tokens,
        )
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.completion() for s in self.seqs], self.finished, metrics, self.error)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        bound_matmul_caches()  # before the first matmul: they read their capacity once (qrun/heap.py)
        self.loaded = load_model(config.model, dtype=config.dtype, device=config.device)
        self.tokenizer = self.loaded.tokenizer
        model_config = self.loaded.config
        self.max_model_len = min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
        self.cache_spec = KVCacheSpec.parse(config.kv_cache_dtype, self.loaded.dtype, self.loaded.kv_dtype)
        num_blocks = self._num_blocks()
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, self.cache_spec, config.max_num_seqs,
                                  self.max_model_len, compile_decode=not config.enforce_eager)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._seq_ids = itertools.count()
        self.num_generated_tokens = 0
        self._decode_step_s = 0.0  # the last decode step's seconds (one token a sequence), 0 before one
        self._grammar_compiler: GrammarCompiler | None = None
        self.step_observers: list[Callable[[StepStats], None]] = []  # called after every step that ran
        self.cpu_threads = CpuThreads() if self.loaded.device.type == "cpu" else None
        log.info("KV cache: %d blocks of %d tokens = %d tokens (%s, %.1f MiB)", num_blocks, config.block_size,
                 num_blocks * config.block_size, self.cache_spec.name,
                 num_blocks * config.block_size * self.cache_spec.bytes_per_token(model_config) / 2**20)
        # Loading leaves Python owing a full collection of what it made (~200,000 objects with SmolLM2: 0.13-0.21 s
        # on a 2-core EPYC), which it would otherwise run inside a step of some later request, stalling its stream.
        gc.collect()

    def _num_blocks(self) -> int:
        config = self.config
        budget = cache_budget(config.kv_cache_memory, self.loaded.device)
        num_blocks = kv_blocks(budget, self.loaded.config, self.cache_spec, config.block_size,
                               config.max_num_seqs, self.max_model_len)
        if num_blocks < 1:
            per_block = self.cache_spec.bytes_per_token(self.loaded.config) * config.block_size
            raise QrunError(
                f"out of cache memory: {budget} bytes hold no {config.block_size}-token KV block "
                f"({per_block} bytes); raise kv_cache_memory or lower block_size"
            )
        return num_blocks

    @property
    def request_token_limit(self) -> int:
        """Most tokens one request may span (prompt + output): the model's context, or the whole
        KV cache if that is smaller."""
        return min(self.max_model_len, self.block_manager.num_blocks * self.config.block_size)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_text_and_ids(prompt)
        self._check_vocabulary(params.logit_bias or (), "logit_bias")
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"model's context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens"
            )
        capacity = self.block_manager.num_blocks * self.config.block_size
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise RequestError(
                f"prompt + max_tokens = {total} tokens can never fit the KV cache ({capacity} tokens); "
                "raise kv_cache_memory or lower max_tokens"
            )
        arrival = arrival_time or time.time()
        request = Request(request_id, text, ids, params, arrival)
        if params.structured_outputs is not None:
            request.matcher = self.grammar_compiler.matcher(params.structured_outputs)
        request.seqs.append(self._new_sequence(request, 0))
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def _prompt_text_and_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if len(prompt) != 1 or not {"prompt", "prompt_token_ids"} & prompt.keys():
                raise RequestError(f"a prompt dict takes one key, 'prompt' (text) or 'prompt_token_ids' (ids), "
                                   f"not {sorted(prompt, key=str)}")
            prompt = next(iter(prompt.values()))
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        try:
            if isinstance(prompt, (bytes, dict)):
                raise TypeError(prompt)
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise RequestError("a prompt is text, a list of token ids, {'prompt': text} or {'prompt_token_ids': ids}; "
                               f"got {prompt!r:.60}") from None
        self._check_vocabulary(ids, "prompt")
        return None, ids

    def _check_vocabulary(self, token_ids: Iterable[int], field_name: str) -> None:
        vocab = self.loaded.config.vocab_size
        outside = next((t for t in token_ids if not 0 <= t < vocab), None)
        if outside is not None:
            raise RequestError(f"{field_name} token id {outside} is outside the vocabulary (0..{vocab - 1})")

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        generator = None
        if request.params.seed is not None:
            generator = torch.Generator(device=self.loaded.device).manual_seed(request.params.seed + index)
        return Sequence(next(self._seq_ids), request.request_id, index, list(request.prompt_token_ids),
                        request.params, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
                        request.arrival_time, generator,
                        logprobs=[] if request.params.logprobs is not None else None,
                        matcher=None if request.matcher is None else request.matcher.copy())

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Made on the first structured-output request (wrapping the tokenizer takes ~1 s)."""
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer.to_json(), self.loaded.config.vocab_size,
                                                     self.eos_token_ids)
        return self._grammar_compiler

    def abort(self, request_id: str) -> None:
        """Stop a request now and free every block it holds; unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish("abort")
                self.scheduler.finish(seq)

    def _fail(self, request_id: str, reason: str, cause: BaseException | None = None) -> None:
        """End a request the engine cannot serve: its unfinished completions finish with "error",
        their blocks go back, and its output's `error` says `reason` (logged, with `cause`'s
        traceback). `_outputs` then reports it finished."""
        request = self.requests[request_id]
        if request.error is None:
            request.error = reason
            log.error("request %s failed: %s", request_id, reason, exc_info=cause)
        for seq in request.seqs:
            if not seq.finished:
                seq.finish("error")
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one forward pass; return the outputs of the requests it advanced (`finished_only`:
        of those it finished, for a caller that collects only final outputs, which spares building
        the others' cumulative outputs every step).

        A fault in one request's share of the step fails that request alone, and a failed
        forward pass fails the step's requests: their outputs end with finish_reason "error".
        A fault outside any request (the scheduler's, say) raises.
        """
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        self.scheduler.decode_steps(batch, self._decode_steps(batch))
        prefill_tokens = sum(  # counted before the step advances num_computed_tokens
            max(0, min(seq.num_computed_tokens + n, len(seq.prompt_token_ids)) - seq.num_computed_tokens)
            for seq, n in zip(batch.seqs, batch.num_tokens)) if self.step_observers else 0
        start = time.perf_counter()
        try:
            if batch.steps > 1:
                decoded, logprobs = self.runner.decode(batch, [self._stop_token_ids(seq) for seq in batch.seqs])
            else:
                logits, sampling, first_max = self.runner.execute(batch)
        except Exception as err:  # noqa: BLE001 - which request caused it is unknowable: all of the step's fail
            log.exception("the forward pass failed")
            for seq in batch.seqs:
                self._fail(seq.request_id, f"the forward pass failed ({type(err).__name__}: {err})")
            return self._outputs({seq.request_id for seq in batch.seqs}, finished_only)
        if batch.total_tokens == len(batch.seqs) * batch.steps:
            self._decode_step_s = (time.perf_counter() - start) / batch.steps
        if batch.steps > 1:
            self._append_decoded(batch.seqs, decoded, logprobs)
        else:
            for seq, n in zip(batch.seqs, batch.num_tokens):
                seq.num_computed_tokens += n
                self.block_manager.commit_computed(seq)
            if sampling:
                self._sample_and_append(sampling, logits, first_max)
        if self.step_observers:
            self._observe(batch, prefill_tokens)
        return self._outputs({seq.request_id for seq in batch.seqs}, finished_only)

    def _outputs(self, request_ids: set[str], finished_only: bool) -> list[RequestOutput]:
        """The current outputs of these requests (finished_only: of the finished ones); finished
        ones are forgotten once reported."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or (finished_only and not request.finished):
                continue
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    @contextmanager
    def _isolated(self, seq: Sequence, stage: str) -> Iterator[None]:
        """Run one request's share of a step: an exception fails that request alone."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - one request's fault must not stop the others
            self._fail(seq.request_id, f"{stage} failed ({type(err).__name__}: {err})", err)

    def _sample_and_append(self, sampling: list[Sequence], logits: torch.Tensor, first_max: list[int] | None) -> None:
        """`first_max`: each logits row's first maximum, -1 where a logit is not finite (None: not known)."""
        sampling, rows = self._fork_new_samples(sampling)
        # Without first maxima: a row's sum is finite only if all its logits are (or they are so
        # large that it overflows: garbage too). Measured on one core for 64 x 49,152 logits:
        # 0.2 ms, against 8 ms for isfinite().all() per row.
        finite = [i >= 0 for i in first_max] if first_max is not None else logits.sum(dim=-1).isfinite().tolist()
        for seq, row in zip(sampling, rows):
            if not finite[row]:
                self._fail(seq.request_id, "the model's logits hold NaN or infinite values")
        bitmask = self._token_bitmask([seq for seq in sampling if not seq.finished])
        rows = [row for seq, row in zip(sampling, rows) if not seq.finished]  # a failed request's have finished
        sampling = [seq for seq in sampling if not seq.finished]
        if not sampling:
            return
        if rows != list(range(logits.shape[0])):
            logits = logits[rows]
        first_max = None if first_max is None else [first_max[row] for row in rows]
        tokens, logprobs = self._sample(logits, sampling, bitmask, first_max)
        for seq, token, lp in zip(sampling, tokens, logprobs):
            if seq.finished:  # its sampling failed, or a sibling's token failed the request
                continue
            with self._isolated(seq, "processing the sampled token"):
                self._append(seq, token, lp)

    def _decode_steps(self, batch: ScheduledBatch) -> int:
        """How many decode steps `batch` may run back to back (the scheduler then checks it can): as
        many as take MAX_DECODE_RUN_S at the last decode step's speed, none past a sequence's
        max_tokens or the model's length, and one where the C++ model does not cover the model or
        cannot pick a sequence's tokens itself (held-back stop tokens, a grammar: `samples_in_runs`)."""
        steps = self.config.num_scheduler_steps
        if self._decode_step_s:
            steps = min(steps, int(MAX_DECODE_RUN_S / self._decode_step_s))
        if steps <= 1 or not self.runner.decodes_in_steps:
            return 1
        for seq in batch.seqs:
            if not samples_in_runs(seq):
                return 1
            steps = min(steps, seq.params.max_tokens - len(seq.output_token_ids), self.max_model_len - len(seq))
        return steps

    def _append_decoded(self, seqs: list[Sequence], decoded: list[list[int]],
                        logprobs: list[list[dict[int, float] | None]]) -> None:
        """Each sequence's tokens of a run of decode steps (a list per step), with their logprobs,
        taken as its steps would have: one computed and one appended at a time, until it finishes
        (later ones are dropped); a token of -1 (logits not finite) fails its request."""
        for row, seq in enumerate(seqs):
            for tokens, step_logprobs in zip(decoded, logprobs):
                if seq.finished:  # a stop; or a sibling failed the request
                    break
                seq.num_computed_tokens += 1
                self.block_manager.commit_computed(seq)
                if tokens[row] < 0:
                    self._fail(seq.request_id, "the model's logits hold NaN or infinite values")
                    break
                with self._isolated(seq, "processing the sampled token"):
                    self._append(seq, tokens[row], step_logprobs[row])

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence], bitmask: torch.Tensor | None,
                first_max: list[int] | None) -> tuple[list[int], list[dict[int, float] | None]]:
        """Sample the batch; if that fails, sample its rows one at a time so only the requests
        whose rows fail do. Seeded rows then draw what the batch would have drawn."""
        generators = [(seq.generator, seq.generator.get_state()) for seq in sampling if seq.generator is not None]
        try:
            return sample(logits, sampling, self.eos_token_ids, bitmask, first_max)
        except Exception:  # noqa: BLE001 - isolated row by row below
            log.warning("sampling a batch failed; sampling its %d rows one at a time", len(sampling), exc_info=True)
        for generator, state in generators:
            generator.set_state(state)
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        constrained_rows = itertools.count()
        for row, seq in enumerate(sampling):
            mask = None
            if seq.matcher is not None:
                constrained = next(constrained_rows)
                mask = bitmask[constrained:constrained + 1]
            token, lp = -1, None  # kept only if sampling the row succeeds
            with self._isolated(seq, "sampling"):
                [token], [lp] = sample(logits[row:row + 1], [seq], self.eos_token_ids, mask)
            tokens.append(token)
            logprobs.append(lp)
        return tokens, logprobs

    def _observe(self, batch: ScheduledBatch, prefill_tokens: int) -> None:
        running = self.scheduler.running
        block_size = self.block_manager.block_size
        stats = StepStats(
            scheduled_tokens=batch.total_tokens, prefill_tokens=prefill_tokens, num_running=len(running),
            live_tokens=sum(seq.num_computed_tokens for seq in running),
            partial_blocks=sum(-(-seq.num_computed_tokens // block_size) for seq in running),
            used_blocks=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
            forward_passes=batch.steps,
        )
        for observer in self.step_observers:
            observer(stats)

    def _fork_new_samples(self, sampling: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """A request with n > 1 forks its other completions when its prompt is done; all share
        the prompt's blocks and sample their first token from the same logits. The sequences
        that sample, each with its logits row."""
        rows, seqs = [], []
        for row, seq in enumerate(sampling):
            rows.append(row)
            seqs.append(seq)
            request = self.requests[seq.request_id]
            if seq.index == 0 and len(request.seqs) < request.params.n and not seq.output_token_ids:
                children = []
                with self._isolated(seq, "starting its other completions"):
                    children = [self._new_sequence(request, index) for index in range(1, request.params.n)]
                if seq.finished:
                    continue
                self.scheduler.fork(seq, children)
                request.seqs += children
                rows += [row] * len(children)
                seqs += children
        return seqs, rows

    def _token_bitmask(self, sampling: list[Sequence]) -> torch.Tensor | None:
        """The tokens each structured-output sequence may sample now, one row each in batch
        order; None when none has a grammar. A matcher that fails fails its request, whose row
        is left out."""
        constrained = [seq for seq in sampling if seq.matcher is not None]
        if not constrained:
            return None
        bitmask = self.grammar_compiler.bitmask(len(constrained))
        for row, seq in enumerate(constrained):
            with self._isolated(seq, "the structured-output grammar"):
                seq.matcher.fill_bitmask(bitmask, row)
        kept = [row for row, seq in enumerate(constrained) if not seq.finished]
        if len(kept) == len(constrained):
            return bitmask
        return bitmask[kept] if kept else None

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        params = seq.params
        previous_len = len(seq.text)
        seq.text += seq.append_token(token)
        self.num_generated_tokens += 1
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        reason = stop_reason = None
        if seq.matcher is not None:
            seq.matcher.advance(token)
            if seq.matcher.finished:  # the grammar is complete: nothing more may follow
                reason = "stop"
        produced = len(seq.output_token_ids)
        if reason is None and produced >= params.min_tokens:
            if token in self._stop_token_ids(seq):
                reason = "stop"
                # as vLLM reports it: EOS ends a completion without a stop reason, a stop token with itself
                stop_reason = None if token in self.eos_token_ids and not params.ignore_eos else token
            elif params.stop_strings:
                stop_reason = self._cut_stop_string(seq, previous_len)
                reason = None if stop_reason is None else "stop"
        if reason is None and (produced >= params.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
        if reason:
            seq.finish(reason, stop_reason)
            self.scheduler.finish(seq)

    def _stop_token_ids(self, seq: Sequence) -> list[int]:
        """The tokens that end `seq` once its min_tokens are out: EOS (unless ignored) and its stop tokens."""
        return (self.eos_token_ids if not seq.params.ignore_eos else []) + (seq.params.stop_token_ids or [])

    @staticmethod
    def _cut_stop_string(seq: Sequence, previous_len: int) -> str | None:
        """Truncate `seq.text` at the first stop string the newest text completes; return that string."""
        longest = max(len(s) for s in seq.params.stop_strings)
        search_from = max(0, previous_len - longest + 1)
        found = [(seq.text.find(s, search_from), s) for s in seq.params.stop_strings]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return None
        index, stop = min(found)
        seq.text = seq.text[:index + (len(stop) if seq.params.include_stop_str_in_output else 0)]
        return stop

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        blocks = self.block_manager
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_free": blocks.num_free_blocks,
            "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks,
            "kv_blocks_cached": blocks.num_cached_blocks,
            "kv_block_references": blocks.num_references,
            "prefix_hit_rate": blocks.prefix_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "generated_tokens": self.num_generated_tokens,
        }

