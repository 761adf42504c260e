"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice or a grammar.

The grammar engine is llguidance, kept behind this module. `scripts/grammar_engines.py` measures
it against xgrammar (README): it sets a schema up ~4x faster (that sits in front of each new
request's admission), fills masks more slowly but at ~1% of a CPU decode step, needs only its own
wheel, and covers the JSON Schema features clients send ($ref/$defs, anyOf/oneOf, pattern, format,
bounds) with an explicit error for the rest. `scripts/structured_outputs_overhead.py` prints what
a constrained batch costs.

- `GrammarCompiler` (one per engine) turns `StructuredOutputsParams` into a checked grammar,
  cached by its canonical text; every error names the field and says why, before the request is
  admitted.
- `Matcher` (one per sequence) fills its row of the step's token bitmask and advances on each
  sampled token. It lives on the sequence, so it survives preemption (recompute rebuilds only
  the KV cache; the tokens it has consumed stay) and is copied for each of `n` completions.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import llguidance
import torch

from qrun.errors import RequestError
from qrun.kernels import ops_for
from qrun.sampling_params import StructuredOutputsParams

# Whitespace between a JSON output's tokens: none, one space, or one or two newlines and an indent of up to 20 spaces
# or tabs (what llama.cpp's json-schema-to-grammar allows). llguidance's default admits any run, in which small
# models loop until max_tokens (SmolLM2 at 4.0 bpw, an array of 3 booleans: "[" and then 119 tokens of spaces and
# newlines). A schema's own "x-guidance" whitespace options take precedence.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"

# Compiled grammars kept per engine: schemas repeat (one per endpoint or tool set), and a cache
# this size holds a service's worth while bounding memory against clients sending new ones.
GRAMMAR_CACHE_SIZE = 256


class StructuredOutputError(RequestError):
    """A structured-output request that cannot be served; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"structured_outputs.{param}: {message}")
        self.param = param


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into row `row` of a step's bitmask."""
        _fill_bitmask(self._matcher, bitmask, row)

    def advance(self, token: int) -> None:
        """Consume the sampled token. A token outside the mask (a stop token the grammar does not
        allow, say) leaves the matcher in its error state, which `finished` reports."""
        self._matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits no further token (or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (it may still go on)."""
        return self._matcher.is_accepting()

    def copy(self) -> "Matcher":
        return Matcher(self._matcher.deep_copy())


class GrammarCompiler:
    """Checked grammars for one tokenizer and vocabulary, cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A fresh matcher for `params`; raises StructuredOutputError if it cannot be served."""
        key = params.canonical()
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._compile(params)
            self._grammars[key] = grammar
            if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return Matcher(llguidance.LLMatcher(self._tokenizer, grammar, log_level=0))

    def bitmask(self, rows: int) -> torch.Tensor:
        """An int32 [rows, words] bitmask with every token allowed, for matchers to fill."""
        return torch.full((rows, -(-self.vocab_size // 32)), -1, dtype=torch.int32)

    def _compile(self, params: StructuredOutputsParams) -> str:
        field = params.kind
        try:
            grammar = _grammar_text(params)
        except ValueError as err:
            raise StructuredOutputError(field, str(err)) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            raise StructuredOutputError(field, _first_line(messages[0]))
        # A grammar can be well formed and still match nothing (a regex like [^\s\S]): ask for the
        # first mask now, so the request fails here rather than producing garbage later.
        probe = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        mask = self.bitmask(1)
        _fill_bitmask(probe, mask, 0)
        if probe.is_error() or not (mask != 0).any() and not probe.is_accepting():
            raise StructuredOutputError(field, "matches no output at all" +
                                        (f" ({_first_line(probe.get_error())})" if probe.is_error() else ""))
        return grammar


def _fill_bitmask(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """`llguidance.torch.fill_next_token_bitmask`, without importing that module: its import loads
    torch.compile's machinery for a kernel qrun does not use (~1.8 s of every `import qrun`)."""
    words = bitmask[row]
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not words.is_contiguous():
        raise ValueError("a grammar's bitmask is a contiguous int32 CPU tensor")
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf the logits of tokens forbidden in row `rows[i]` (ascending) by `bitmask[i]`; the
    other rows are untouched, so free requests cost nothing. In place, on each run of consecutive
    rows as a view (gathering the rows and scattering them back took 0.1 ms a step at one row)."""
    mask_logits = ops_for(logits.device).mask_logits
    bitmask = bitmask.to(logits.device)
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end] == rows[end - 1] + 1:
            end += 1
        mask_logits(logits[rows[start]:rows[end - 1] + 1], bitmask[start:end])
        start = end


def _grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params`; ValueError with a message for the client."""
    if params.json is not None:
        return _json_grammar(json.loads(params.json) if isinstance(params.json, str) else params.json)
    if params.json_object:
        return _json_grammar({"type": "object"})
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # Lark string literals take JSON's escapes, so any text is one quoted alternative.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    grammar = params.grammar
    if "::=" in grammar:  # GBNF, as llama.cpp and vLLM's clients write it
        grammar = llguidance.gbnf_to_lark(grammar)
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def _json_grammar(schema: dict | bool) -> str:
    """The grammar of a JSON schema, its whitespace bounded by JSON_WHITESPACE unless the schema says otherwise
    (a boolean schema takes no options)."""
    own = schema.get("x-guidance", {}) if isinstance(schema, dict) else None
    keeps_own = own is None or not isinstance(own, dict) or {"whitespace_flexible", "whitespace_pattern"} & own.keys()
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults=None if keeps_own else {"whitespace_pattern": JSON_WHITESPACE})


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"
