"""The OpenAI request fields the server accepts, and OpenAI's error shape."""

from __future__ import annotations

import math
import re
from typing import Any

from fastapi.responses import JSONResponse

from qrun.sampling_params import SamplingParams


# -- errors -----------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)=")


def _param_from_value_error(err: ValueError) -> str | None:
    """SamplingParams names the field it rejects; report it under the OpenAI field name."""
    match = _PARAM_IN_MESSAGE.search(str(err))
    if not match:
        return None
    name = match.group(1)
    return {"logprobs": "logprobs", "stop_strings": "stop"}.get(name, name)


# -- request field parsing --------------------------------------------------------------------
# Typed getters: a missing or null field takes the default; a wrong type is a 400 naming it.
def _number(body: dict, name: str, default: float | None, low: float | None = None,
            high: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(name, f"must be in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int | None = None,
             high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _bad(name, f"must be an integer in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


def _stop(body: dict) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "must be a non-empty string or a list of them")
    return stops


def sampling_params(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """SamplingParams from the OpenAI fields and qrun's extensions (top_k, min_p, ...)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0),
            n=_integer(body, "n", 1, 1, 16),
            stop=_stop(body),
            seed=_integer(body, "seed", None),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            logprobs=logprobs,
            top_k=_integer(body, "top_k", -1),
            min_p=_number(body, "min_p", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            min_tokens=_integer(body, "min_tokens", 0),
            ignore_eos=_boolean(body, "ignore_eos", False),
        )
    except ValueError as err:
        param = _param_from_value_error(err)
        raise ApiError(400, str(err), param) from None


def _max_tokens(body: dict) -> int | None:
    # max_completion_tokens is the newer chat name of the same limit.
    newer = _integer(body, "max_completion_tokens", None, 1)
    return newer if newer is not None else _integer(body, "max_tokens", None, 1)


def _prompts(body: dict) -> list[str | list[int]]:
    """A completions prompt: text, token ids, or a batch of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return list(prompt)
    raise _bad("prompt", "must be a string, a list of strings, a list of token ids, or a list of those")


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    return _boolean(options, "include_usage", False)


def _check_common(body: dict) -> None:
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise _bad("model", "must be a string")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "must be a string")
