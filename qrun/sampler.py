"""From a batch of logits to one token per sequence, each under its own SamplingParams."""

from __future__ import annotations

import torch

from qrun.kernels import ops_for
from qrun.sampling_params import SamplingParams
from qrun.sequence import Sequence
from qrun.structured_outputs import apply_bitmask

# Below this a temperature only rescales float noise: treat it as greedy.
MIN_TEMPERATURE = 1e-5


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Each row's logit bias first (OpenAI's: added to the model's logits); then the repetition
    penalty over prompt and output tokens (as transformers applies it), presence and frequency
    penalties over output tokens (as OpenAI defines them). In place."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.logit_bias:
            tokens = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[row, tokens] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty,
                                            values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def suppress_early_stops(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int]) -> None:
    """Until min_tokens are out, no stop token may be sampled. In place."""
    for row, seq in enumerate(seqs):
        if len(seq.output_token_ids) < seq.params.min_tokens:
            stops = [t for t in [*eos_token_ids, *(seq.params.stop_token_ids or [])] if t < logits.shape[1]]
            logits[row, stops] = float("-inf")


def draw_params(seqs: list[Sequence], vocab: int) -> tuple[list[float], list[int], list[float], list[float]]:
    """Each sequence's arguments of the draw kernels (`kernels/draw.py`): its temperature (0 where
    it is greedy), top_k (capped at the vocabulary, which means no limit: a larger one means the
    same and may not fit an int64), top_p and min_p."""
    params = [seq.params for seq in seqs]
    return ([p.temperature if p.temperature >= MIN_TEMPERATURE else 0.0 for p in params],
            [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
            [p.top_p for p in params], [p.min_p for p in params])


def uniforms(seqs: list[Sequence], steps: int, device: torch.device) -> torch.Tensor:
    """float64 [steps, B]: each sequence's uniform for each of `steps` draws, one a step, by inverse
    CDF (an exponential race drew one a token: 0.85 ms a row of 49,152 on a 2-core Xeon). A seeded
    sequence draws from its own generator, so its tokens do not depend on the rest of the batch,
    and `steps` drawn at once are the ones `steps` single draws give."""
    drawn = torch.rand(steps, len(seqs), dtype=torch.float64, device=device)
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            drawn[:, row] = torch.rand(steps, dtype=torch.float64, device=device, generator=seq.generator)
    return drawn


class RunSampling:
    """How a run of decode steps picks its sequences' tokens itself (the C++ model's decode, which
    takes `arguments`): each sequence's draw arguments (`draw_params`) and its uniforms of every
    step, drawn up front as the steps' `sample` calls would draw them; its penalties, with its
    tokens where it has any; how many alternatives its logprobs report (-1: no logprobs)."""

    def __init__(self, seqs: list[Sequence], steps: int, vocab: int, device: torch.device):
        temperature, top_k, top_p, min_p = draw_params(seqs, vocab)
        sampled = any(temperature)
        self._steps = steps
        self._states = [(seq.generator, seq.generator.get_state())
                        for seq in seqs if sampled and seq.generator is not None]
        drawn = uniforms(seqs, steps, device) if sampled else torch.empty(0, len(seqs), dtype=torch.float64)
        params = [seq.params for seq in seqs]
        penalised = [_penalised(p) for p in params]
        # temperature (0: greedy), top_k, top_p, min_p a sequence; uniforms [steps, B] ([0, B] where all are
        # greedy); repetition, presence and frequency penalties; a penalised sequence's tokens and prompt length;
        # logprobs' alternatives
        self.arguments = (temperature, top_k, top_p, min_p, drawn, [p.repetition_penalty for p in params],
                          [p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                          [seq.token_ids if pen else [] for seq, pen in zip(seqs, penalised)],
                          [len(seq.prompt_token_ids) if pen else 0 for seq, pen in zip(seqs, penalised)],
                          [-1 if p.logprobs is None else p.logprobs for p in params])
        self._logprob_counts = [p.logprobs for p in params]

    @staticmethod
    def greedy_arguments(rows: int) -> tuple:
        """`arguments` of `rows` greedy sequences without penalties or logprobs."""
        return ([0.0] * rows, [1] * rows, [1.0] * rows, [0.0] * rows, torch.empty(0, rows, dtype=torch.float64),
                [1.0] * rows, [0.0] * rows, [0.0] * rows, [[] for _ in range(rows)], [0] * rows, [-1] * rows)

    def logprobs(self, decoded: list[list[int]], chosen: torch.Tensor, top_values: torch.Tensor,
                 top_ids: torch.Tensor) -> list[list[dict[int, float] | None]]:
        """Each step's logprobs of the run's sequences (`logprob_entries`), from the C++ model's decode:
        its tokens a list per step, and `top_logprobs`' outputs a row per step."""
        if all(count is None for count in self._logprob_counts):
            return [[None] * len(tokens) for tokens in decoded]
        return [logprob_entries(tokens, self._logprob_counts, *found)
                for tokens, *found in zip(decoded, chosen, top_values, top_ids)]

    def rewind(self, steps_run: int) -> None:
        """For a run that ended after `steps_run` of its steps (a sequence's logits not finite): the
        seeded sequences' generators as that many steps of `sample` leave them."""
        if steps_run == self._steps:
            return
        for generator, state in self._states:
            generator.set_state(state)
            torch.rand(steps_run, dtype=torch.float64, device=generator.device, generator=generator)


def samples_in_runs(seq: Sequence) -> bool:
    """Whether the C++ model can pick `seq`'s next tokens itself, run after run (ModelRunner.decode):
    no held-back stop tokens, no grammar, no logit bias; temperature, top-k/p, min-p, penalties and
    logprobs it applies as `sample` does."""
    return not (_held_back_or_constrained(seq) or seq.params.logit_bias)


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


def _held_back_or_constrained(seq: Sequence) -> bool:
    """Whether stop tokens are held back (min_tokens) or a grammar constrains `seq`'s next token."""
    return len(seq.output_token_ids) < seq.params.min_tokens or seq.matcher is not None


def _rewrites_logits(seq: Sequence) -> bool:
    """Whether a logit bias, penalties, held-back stop tokens or a grammar change this row before sampling."""
    return bool(seq.params.logit_bias) or _penalised(seq.params) or _held_back_or_constrained(seq)


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: list[int],
           token_bitmask: torch.Tensor | None = None,
           first_max: list[int] | None = None) -> tuple[list[int], list[dict[int, float] | None]]:
    """One token per row of `logits` ([B, V] float32), and its logprobs where asked for.
    `token_bitmask` ([C, words] int32) holds the tokens allowed to each of the C sequences that
    have a grammar, in batch order. `first_max`: each row's first maximum where the caller found
    it with the logits (the C++ model): a greedy batch whose logits nothing rewrites takes it
    as its tokens. `logits` is left as it was, so a caller can sample a row again (the engine
    does, one row at a time, when a batch fails)."""
    params = [s.params for s in seqs]
    greedy = [p.temperature < MIN_TEMPERATURE for p in params]
    rewrites = any(_rewrites_logits(seq) for seq in seqs)
    if first_max is not None and all(greedy) and not rewrites:
        return first_max, _logprobs(logits, params, first_max)
    if rewrites:  # copied only then: a greedy free batch pays nothing
        logits = logits.clone()
    apply_penalties(logits, seqs)
    suppress_early_stops(logits, seqs, eos_token_ids)
    if token_bitmask is not None:
        apply_bitmask(logits, token_bitmask, [row for row, seq in enumerate(seqs) if seq.matcher is not None])
    device = logits.device
    tokens = ops_for(device).first_max(logits)
    if not all(greedy):
        temperature, top_k, top_p, min_p = draw_params(seqs, logits.shape[1])
        sampled = ops_for(device).draw(
            logits, torch.tensor(temperature, device=device),
            torch.tensor(top_k, device=device), torch.tensor(top_p, device=device),
            torch.tensor(min_p, device=device), uniforms(seqs, 1, device)[0])
        # greedy rows (not drawn: temperature 0), and rows with no distribution to draw from: their first maximum
        tokens = torch.where(sampled < 0, tokens, sampled)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, params, token_list)


def _logprobs(logits: torch.Tensor, params, tokens: list[int]) -> list[dict[int, float] | None]:
    counts = [p.logprobs for p in params]
    asked = [row for row, count in enumerate(counts) if count is not None]
    if not asked:
        return [None] * len(params)
    found = ops_for(logits.device).top_logprobs(
        logits[asked], torch.tensor([tokens[row] for row in asked], device=logits.device),
        max(counts[row] for row in asked))
    entries = iter(logprob_entries([tokens[row] for row in asked], [counts[row] for row in asked], *found))
    return [None if count is None else next(entries) for count in counts]


def logprob_entries(tokens: list[int], counts: list[int | None], chosen: torch.Tensor, top_values: torch.Tensor,
                    top_ids: torch.Tensor) -> list[dict[int, float] | None]:
    """Each row's logprobs as a sequence reports them: its token's, then those of up to counts[row]
    likeliest others (None where counts[row] is None: not asked for), from `top_logprobs`' outputs
    (`kernels/logprobs.py`) for the rows' `tokens`."""
    entries: list[dict[int, float] | None] = []
    for token, count, value, values, ids in zip(tokens, counts, chosen.tolist(), top_values.tolist(),
                                                top_ids.tolist()):
        if count is None:
            entries.append(None)
            continue
        entry = {token: value}
        for alternative, alternative_id in zip(values[:count], ids[:count]):
            if alternative > float("-inf"):  # a token a grammar forbids is no alternative
                entry.setdefault(alternative_id, alternative)
        entries.append(entry)
    return entries
