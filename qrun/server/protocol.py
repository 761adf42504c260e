"""What the server accepts and how it says no: the request bodies as pydantic models (FastAPI
validates them and publishes them in /openapi.json) and OpenAI's error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Sequence

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator,
                      model_validator)
from pydantic_core import PydanticCustomError

from qrun.sampling_params import MAX_LOGPROBS, InvalidSamplingParam, SamplingParams

# Limits on one request. There is no cap on the body's size or on the number of stop strings.
MAX_N = 16  # choices per prompt
MAX_TEMPERATURE = 2.0  # OpenAI's
# Seeds reach torch as 64-bit integers; /openapi.json states bounds as doubles, and these two
# are exact (2**63 - 1 would read as 2**63).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 2**10
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

NOT_JSON = "the request body is not valid JSON"
NOT_AN_OBJECT = "the request body must be a JSON object"
NOT_JSON_CONTENT = "the request body must be JSON, sent with Content-Type: application/json"


# -- errors -----------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="the request field at fault, as a path: messages[0].role")
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class ApiError(Exception):
    """An error answered as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.status)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(errors: Sequence[Any]) -> ApiError:
    """The first of FastAPI's request validation errors as a 400, `param` naming the field."""
    error = errors[0]
    where = error["loc"][1:]  # after "body"
    if error["type"] == "json_invalid" or (not where and error["type"] == "missing"):  # unreadable or empty
        return ApiError(400, NOT_JSON)
    if not where:  # JSON but no object, or bytes: FastAPI reads only a JSON Content-Type as JSON
        return ApiError(400, NOT_JSON_CONTENT if isinstance(error.get("input"), bytes) else NOT_AN_OBJECT)
    param = str(where[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where[1:])
    return ApiError(400, f"{param}: {error['msg']}", param)


def _one_of(shapes: str) -> WrapValidator:
    """Report a union that matched no member as one error naming the accepted shapes, instead
    of an error per member whose location names the member's type rather than a field."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("shape", "must be {shapes}", {"shapes": shapes}) from None

    return WrapValidator(validate)


# -- request bodies ---------------------------------------------------------------------------
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = Annotated[
    NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)],
    _one_of("a non-empty string, a list of them, a list of token ids (>= 0), or a list of those"),
]


class RequestBody(BaseModel):
    """JSON types as the schema says (2 is no string, "2" no number, NaN no number). Fields
    qrun has no use for (metadata, logit_bias, ...) are ignored, as OpenAI's clients send them.
    Null means "not set": the field takes its default (so the schema admits null throughout)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(RequestBody):
    include_usage: bool | None = Field(False, description="end the stream with a chunk carrying the usage")


class SamplingRequest(RequestBody):
    """The fields both endpoints take: OpenAI's, and qrun's extensions with vLLM's names
    (top_k, min_p, repetition_penalty, min_tokens, ignore_eos)."""

    model: str | None = Field(None, description="ignored: the server serves one model")
    user: str | None = Field(None, description="ignored")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="default: all the model's context (or the KV cache) leaves after the prompt")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="the newer name of max_tokens; wins over it")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(0, description="at most max_tokens")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(1.0, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[Literal[-1] | Annotated[int, Field(ge=1)],
                     _one_of("-1 (disabled) or an integer >= 1")] | None = -1
    min_p: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(1.0, description="1: none")
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(1, description="choices per prompt")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Annotated[NonEmptyStr | list[NonEmptyStr], _one_of("a non-empty string or a list of them")] | None = None
    ignore_eos: bool | None = False
    stream: bool | None = Field(False, description="answer as server-sent events")
    stream_options: StreamOptions | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, n=self.n, stop=self.stop,
                seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logprobs=logprobs, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)
        except InvalidSamplingParam as err:  # what no field says alone: min_tokens above max_tokens
            raise ApiError(400, str(err), err.name) from None


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions."""

    prompt: Prompt = Field(description="one prompt or a batch; each gets n choices")
    max_tokens: Annotated[int, Field(ge=1)] | None = COMPLETION_MAX_TOKENS
    echo: bool | None = Field(False, description="put the prompt before each choice's text")
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="log probabilities of the sampled tokens and this many alternatives")

    def prompts(self) -> list[str | list[int]]:
        """One engine request each: the prompt, or each prompt of a batch."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One turn. Keys besides role and content (name, tool_call_id, ...) reach the chat template
    as sent, so they are kept, not checked."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str = Field(description="system, user, assistant, or another role the model's chat template knows")
    content: Annotated[str | list[TextPart], _one_of("a string or a list of text parts")] | None = Field(
        None, description="text, or text parts (joined); null is empty")


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = Field(False, description="log probabilities of the sampled tokens")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        0, description="with logprobs: this many alternatives per token")
