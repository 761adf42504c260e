"""Text <-> token ids, chat templates, and incremental detokenization for streaming."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qrun.atomic import atomic_write_text
from qrun.errors import ModelLoadError, QrunError, one_line
from qrun.sources import read_json_object

# Used when a model ships no chat template: plain "role: content" turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _config_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a tokenizer_config.json this class reads, if anything."""
    template = config.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template)
    if template is not None and not isinstance(template, str) and not named:
        return "chat_template must be a template or a list of {name, template} objects"
    for key in ("bos_token", "eos_token"):
        token = config.get(key)
        if token is not None and not isinstance(token, str) and not isinstance(_token_text(token), str):
            return f"{key} must be a string or an object with a string content, got {token!r:.40}"
    return None


def chat_messages(value: Any) -> list[dict[str, str]]:
    """Validated chat messages: a non-empty list of {"role": str, "content": str} objects, where
    content may also be a list of OpenAI text parts (joined) or null (empty). Other keys are
    kept. Raises ValueError naming the field at fault ("messages[2].content: ...")."""
    if not isinstance(value, list) or not value:
        raise ValueError("messages: must be a non-empty list of {role, content} objects")
    flat = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}]: must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string or a list of text parts")
        flat.append({**message, "content": content})
    return flat


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, tokenizer_config: dict[str, Any],
                 eos_token_ids: list[int]):
        self._tok = tokenizer
        self.config = tokenizer_config
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        self.chat_template: str | None = tokenizer_config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default", next(iter(named.values()), None))
        ids = list(eos_token_ids)
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        self.eos_token_ids = ids
        # One past the highest id (a count of tokens would miss ids past a gap).
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.special_ids = set(tokenizer.get_added_tokens_decoder())

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: list[int]) -> "Tokenizer":
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; copy the tokenizer files from the original model into it"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:
            raise ModelLoadError(f"{path} is not a valid tokenizer file ({one_line(err)})") from None
        config_path = folder / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        problem = _config_problem(config)
        if problem:
            raise ModelLoadError(f"{config_path}: {problem}")
        generation = folder / "generation_config.json"
        if generation.is_file():
            eos = read_json_object(generation).get("eos_token_id")
            ids = [eos] if isinstance(eos, int) else (eos or [])
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ModelLoadError(f"{generation}: eos_token_id must be a token id or a list of them, "
                                     f"got {eos!r:.40}")
            for token_id in ids:
                if token_id not in eos_token_ids:
                    eos_token_ids = [*eos_token_ids, token_id]
        return cls(tok, config, eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what grammar engines build their vocabulary from)."""
        return self._tok.to_str()

    def save(self, folder: Path) -> None:
        """tokenizer.json and tokenizer_config.json, as from_folder reads them."""
        atomic_write_text(folder / "tokenizer.json", self.to_json())
        config = {k: v for k, v in self.config.items() if v is not None}
        atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=1))

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """encode() of each text, in parallel across cores."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def encode_chat(self, messages: list[dict[str, str]], template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Prompt ids of `messages` rendered by the chat template (or `template`), ready for the
        reply: what every entry point (CLI, chat, server) sends. The template writes any BOS
        itself, as Hugging Face's apply_chat_template(tokenize=True) assumes, so the tokenizer's
        own special tokens are not added (a BOS post-processor would add a second one)."""
        return self.encode(self.apply_chat_template(messages, template=template, tools=tools),
                           add_special_tokens=False)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template writes a `tools` list into the prompt itself."""
        return "tools" in (self.chat_template or "")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            template: str | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        """Render `messages` with the model's template (or `template`) in a jinja2 sandbox."""
        source = template or self.chat_template or FALLBACK_CHAT_TEMPLATE
        try:
            return _compiled_template(source).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except TemplateError as err:
            raise QrunError(f"the chat template rejected the conversation: {err}") from None


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


# The sandbox every chat template renders in, with the helpers Hugging Face's templates call.
_TEMPLATES = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_TEMPLATES.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> Template:
    """A chat template compiled once: compiling SmolLM2's took 1.9 ms of every chat request, rendering it
    40 us (one-off probe, a 2-core Xeon). A syntax error is the caller's TemplateError."""
    return _TEMPLATES.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and word-boundary spaces, so each
    delta is the difference between decoding a short trailing window with and without the
    newest tokens; a delta ending in an incomplete character is held back.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])  # context so the first token decodes with its leading space
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
