"""OpenAI tool calling on top of the chat template and structured outputs.

A request's `tools` reach the prompt through the model's chat template when it renders tools
(it then tells the model its own call format); otherwise a system message lists them and asks
for a JSON call. `tool_choice`:
- "none": the tools are not offered; the answer is text.
- "auto" (the default with tools): the model decides; its output is parsed for calls in its
  template's format (Hermes/Qwen `<tool_call>{...}</tool_call>`) or as a bare JSON call
  (`{"name": ..., "arguments"|"parameters": {...}}`, Llama 3's form); anything else is text.
- "required" / {"type": "function", "function": {"name"}}: the output is constrained to a JSON
  list of calls (required) or one call (named) whose arguments match each function's
  `parameters` schema, so they always validate.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from qrun.sampling_params import StructuredOutputsParams

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


@dataclass
class ToolCalling:
    """One chat request's tools and its tool_choice ("auto", "required", or a function name)."""

    functions: list[dict[str, Any]]  # OpenAI function specs: name, description, parameters
    choice: str  # "auto", "required" or "named"
    named: str | None = None

    @classmethod
    def from_request(cls, tools: list[dict[str, Any]] | None, tool_choice: Any) -> "ToolCalling | None":
        """None when the answer is plain text (no tools, or tool_choice "none"). The request
        model has checked the shapes; a named function missing from `tools` is a ValueError."""
        if not tools or tool_choice == "none":
            return None
        functions = [tool["function"] for tool in tools]
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            if name not in {f["name"] for f in functions}:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            return cls(functions, "named", name)
        return cls(functions, tool_choice or "auto")

    # -- the prompt -------------------------------------------------------------------------
    def template_tools(self) -> list[dict[str, Any]]:
        """`tools` as chat templates take them (Hugging Face's convention: OpenAI tool objects)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def instructions(self) -> str:
        """A system message for templates that render no tools."""
        listed = json.dumps(self.functions, ensure_ascii=False, separators=(",", ":"))
        return f'Functions you may call: {listed}\nTo call one, answer only {{"name": ..., "arguments": {{...}}}}.'

    # -- the output -------------------------------------------------------------------------
    def constraint(self) -> StructuredOutputsParams | None:
        """The schema a required or named choice's output must follow; None for auto."""
        if self.choice == "auto":
            return None
        calls = [_call_schema(f) for f in self.functions if self.choice == "required" or f["name"] == self.named]
        if self.choice == "named":
            return StructuredOutputsParams(json=calls[0])
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI `tool_calls` the output makes, or None when it is a text answer."""
        payloads: list[Any]
        hermes = _HERMES_CALL.findall(text)
        if hermes:
            payloads = [_json_or_none(p) for p in hermes]
        else:
            parsed = _json_or_none(text.strip())
            payloads = parsed if isinstance(parsed, list) else [parsed]
        known = {f["name"] for f in self.functions}
        calls = []
        for payload in payloads:
            if not (isinstance(payload, dict) and payload.get("name") in known):
                return None
            arguments = payload.get("arguments", payload.get("parameters", {}))
            if isinstance(arguments, str):  # some models write the arguments as a JSON string already
                arguments = _json_or_none(arguments)
            if not isinstance(arguments, dict):
                return None
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": payload["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}})
        return calls or None


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or _ANY_ARGUMENTS},
            "required": ["name", "arguments"], "additionalProperties": False}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
