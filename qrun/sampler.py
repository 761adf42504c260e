"""From a batch of logits to one token per sequence, each under its own SamplingParams."""

from __future__ import annotations

import torch

from qrun.kernels import ops_for
from qrun.sequence import Sequence
from qrun.structured_outputs import apply_bitmask

# Below this a temperature only rescales float noise: treat it as greedy.
MIN_TEMPERATURE = 1e-5


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition penalty over prompt and output tokens (as transformers applies it); presence
    and frequency penalties over output tokens (as OpenAI defines them). In place."""
    for row, seq in enumerate(seqs):
        p = seq.params
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


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside each row's top-k, nucleus (top-p) and min-p sets with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    remove = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p; the top token always stays.
    remove |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf")))


def greedy_on_raw_logits(seq: Sequence) -> bool:
    """Whether `seq`'s next token is its logits' first maximum as the model gives them, and all it
    needs of them: greedy, no logprobs, nothing rewriting the logits (the C++ model may then decode
    its tokens back to back: ModelRunner.decode)."""
    return seq.params.temperature < MIN_TEMPERATURE and seq.params.logprobs is None and not _rewrites_logits(seq)


def _rewrites_logits(seq: Sequence) -> bool:
    """Whether penalties, held-back stop tokens or a grammar change this row before sampling."""
    p = seq.params
    return (p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)
            or len(seq.output_token_ids) < p.min_tokens or seq.matcher is not None)


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
    first_max_of = ops_for(device).first_max  # the kernel table's argmax
    tokens = first_max_of(logits)
    if not all(greedy):
        temperature = torch.tensor([max(p.temperature, MIN_TEMPERATURE) for p in params], device=device)
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            vocab = logits.shape[1]
            scaled = truncate(
                scaled,
                # Capped at the vocabulary: a larger top_k means the same and may not fit an int64.
                torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            )
        probs = scaled.softmax(dim=-1)
        # Exponential race (argmax of p / Exp(1)) samples from p. A seeded row draws its noise
        # from its own generator, so its tokens do not depend on the rest of the batch.
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        sampled = first_max_of(probs / noise)
        tokens = torch.where(torch.tensor(greedy, device=device), tokens, sampled)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, params, token_list)


def _logprobs(logits: torch.Tensor, params, tokens: list[int]) -> list[dict[int, float] | None]:
    wanted = [p.logprobs is not None for p in params]
    if not any(wanted):
        return [None] * len(params)
    rows = [i for i, w in enumerate(wanted) if w]
    logprobs = logits[rows].log_softmax(dim=-1)
    most = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(max(most, 1), dim=-1) if most else (None, None)
    result: list[dict[int, float] | None] = [None] * len(params)
    for j, i in enumerate(rows):
        entry = {tokens[i]: float(logprobs[j, tokens[i]])}
        for k in range(params[i].logprobs):
            if top_values[j, k] > float("-inf"):  # a token a grammar forbids is no alternative
                entry.setdefault(int(top_ids[j, k]), float(top_values[j, k]))
        result[i] = entry
    return result
