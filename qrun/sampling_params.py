"""How one request wants its tokens chosen, with vLLM's field names."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# Most alternatives per sampled token that logprobs may report (OpenAI's limit too).
MAX_LOGPROBS = 20
# A logit bias's bound either way (OpenAI's): -100 bans a token in practice, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0


class InvalidSamplingParam(ValueError):
    """One field out of range; `name` is the field, for APIs that point their clients at it."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise InvalidSamplingParam(name, f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")


def _logit_bias(value: object) -> dict[int, float] | None:
    """A logit bias as token id -> bias; ids may be given as decimal strings, as JSON objects' keys are."""
    if value is None:
        return None
    allowed = f"an object of token ids (>= 0) to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    _check(isinstance(value, dict), "logit_bias", value, allowed)
    bias = {}
    for token, amount in value.items():
        if isinstance(token, str) and token.isascii() and token.isdecimal():
            token = int(token)
        _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0
               and isinstance(amount, (int, float)) and not isinstance(amount, bool)
               and -MAX_LOGIT_BIAS <= amount <= MAX_LOGIT_BIAS, "logit_bias", value, allowed)
        bias[token] = float(amount)
    return bias or None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's shape): exactly one of a JSON schema (a dict
    or its JSON text), any JSON object, a regex, one of a list of strings, or a grammar (Lark,
    or GBNF as llama.cpp writes it)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidSamplingParam("structured_outputs", "structured_outputs takes exactly one of json, regex, "
                                       f"choice, grammar, json_object; got {', '.join(given) or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise InvalidSamplingParam("structured_outputs.json", f"structured_outputs.json is not JSON: {err}")
            if not isinstance(schema, (dict, bool)):
                raise InvalidSamplingParam("structured_outputs.json",
                                           "structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidSamplingParam(f"structured_outputs.{name}", f"structured_outputs.{name} must be a "
                                           "non-empty string")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidSamplingParam("structured_outputs.choice",
                                       "structured_outputs.choice must be a non-empty list of non-empty strings")

    @classmethod
    def from_response_format(cls, value: object) -> "StructuredOutputsParams | None":
        """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", ...}) as
        structured outputs; None for plain text."""
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise InvalidSamplingParam("response_format.json_schema",
                                           'response_format.json_schema must be {"name", "schema", "strict"}')
            # No schema means any JSON value; OpenAI's clients always send one.
            return cls(json=spec.get("schema", {}))
        raise InvalidSamplingParam("response_format.type", "response_format.type must be text, json_object or "
                                   f"json_schema, not {kind!r}")

    @property
    def kind(self) -> str:
        """The field that is set: json, regex, choice, grammar or json_object."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def canonical(self) -> str:
        """One text per distinct constraint (key order and spacing of a schema do not matter)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


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
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # added to a token's logit before anything else (OpenAI's)
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
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        self.stop_strings = tuple(stops)
        self.logit_bias = _logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
