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


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`probs` [B, V] (rows of a softmax) with every token outside its row's top-k, nucleus (top-p,
    within the top-k renormalized) and min-p sets zeroed; the likeliest token always stays. top_k
    is capped at V (V: no limit). A new tensor."""
    vocab = probs.shape[1]
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    limited = (top_k < vocab) | (top_p < 1)
    if bool(limited.any()):
        keep &= _top_k_and_nucleus(probs, top_k, top_p, limited) | ~limited[:, None]
    return probs * keep


def _top_k_and_nucleus(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       limited: torch.Tensor) -> torch.Tensor:
    """Which tokens of the `limited` rows of `probs` [B, V] top-k and top-p keep: a token stays
    while fewer than top_k come before it and the mass before it, over the top-k's, is at most
    top_p. Sorted are only as many tokens as a row may keep: its top-k, or, without one, the tokens
    above (1 - top_p) / V of its mass (below that a token and all less likely ones hold less than
    1 - top_p, so more than top_p comes before it). A sort of a 49,152-token row took 2.8 ms on a
    2-core Xeon."""
    vocab = probs.shape[1]
    total = probs.sum(dim=-1)
    floor = (1 - top_p) * total / vocab * (1 - 1e-6)
    candidates = torch.where(top_k < vocab, top_k, (probs > floor[:, None]).sum(dim=-1))
    # at least one: a row of NaN (every logit -inf) has no candidate
    values, ids = probs.topk(max(1, int(torch.where(limited, candidates, 1).max())), dim=-1)
    count = values.shape[1]
    cumulative = values.cumsum(dim=-1)
    top_k_mass = cumulative.gather(1, (top_k.clamp(max=count) - 1)[:, None]).squeeze(1)
    norm = torch.where(top_k < vocab, top_k_mass, total)
    ranks = torch.arange(count, device=probs.device)
    kept = (ranks[None, :] < top_k[:, None]) & (cumulative - values <= top_p[:, None] * norm[:, None])
    kept[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, ids, kept)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token a row of `probs` [B, V] (non-negative, not necessarily summing to 1), drawn in
    proportion to them by `uniforms` [B] in [0, 1): the first token whose cumulative mass exceeds
    that share of the row's. float64 sums, so each token's share is its own to ~1e-16. -1 for a
    row whose mass is not a positive finite number (NaN probabilities: a row of logits all -inf)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    tokens = torch.searchsorted(cdf, (uniforms.to(torch.float64) * total)[:, None], right=True).squeeze(1)
    return torch.where(torch.isfinite(total) & (total > 0), tokens, -1)


def at_infinity(logits: torch.Tensor) -> torch.Tensor:
    """`logits` with each row that reaches +inf (a repetition penalty near 0 divides a seen token's
    positive logit to infinity) replaced by its limit, 0 at the infinite ones and -inf elsewhere: a
    softmax then gives what it tends to, equal shares of the infinite ones, not NaN."""
    if not torch.isposinf(logits.amax()):  # one pass where no row does
        return logits
    infinite = torch.isposinf(logits)
    return torch.where(infinite.any(dim=-1, keepdim=True), torch.where(infinite, 0.0, float("-inf")), logits)


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
        probs = at_infinity(logits / temperature[:, None]).softmax(dim=-1)
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            vocab = logits.shape[1]
            probs = truncate(
                probs,
                # Capped at the vocabulary: a larger top_k means the same and may not fit an int64.
                torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            )
        # One uniform a row, by inverse CDF (an exponential race drew one a token: 0.85 ms a row of 49,152
        # on a 2-core Xeon). A seeded row draws from its own generator, so its tokens do not depend on the
        # rest of the batch.
        uniforms = torch.rand(len(seqs), dtype=torch.float64, device=device)
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                uniforms[row] = torch.rand((), dtype=torch.float64, device=device, generator=seq.generator)
        sampled = inverse_cdf(probs, uniforms)
        # greedy rows, and rows with no distribution to draw from: their logits' first maximum
        tokens = torch.where(torch.tensor(greedy, device=device) | (sampled < 0), tokens, sampled)
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, params, token_list)


def _logprobs(logits: torch.Tensor, params, tokens: list[int]) -> list[dict[int, float] | None]:
    wanted = [p.logprobs is not None for p in params]
    if not any(wanted):
        return [None] * len(params)
    rows = [i for i, w in enumerate(wanted) if w]
    logprobs = at_infinity(logits[rows]).log_softmax(dim=-1)
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
