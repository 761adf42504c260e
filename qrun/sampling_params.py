"""How one request wants its tokens chosen, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field

# Most alternatives per sampled token that logprobs may report (OpenAI's limit too).
MAX_LOGPROBS = 20


class InvalidSamplingParam(ValueError):
    """One field out of range; `name` is the field, for APIs that point their clients at it."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise InvalidSamplingParam(name, f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "an integer >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 means greedy)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
               "-1 (disabled) or an integer >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
               "> 0 (1 disables it)")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer or None")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _check(all(isinstance(s, str) and s for s in stops), "stop", self.stop, "non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids or []), "stop_token_ids",
               self.stop_token_ids, "non-negative token ids")
        self.stop_strings = tuple(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
