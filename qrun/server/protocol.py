"""What the server accepts and how it says no: the request bodies as pydantic models (FastAPI
validates them and publishes them in /openapi.json) and OpenAI's error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Sequence

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler,
                      WrapValidator, model_validator)
from pydantic_core import PydanticCustomError

from qrun.sampling_params import MAX_LOGPROBS, InvalidSamplingParam, SamplingParams, StructuredOutputsParams

# Limits on one request, so that one client cannot take the engine or the server's memory:
# beyond them the answer is a 400 naming the field (413 for the body).
MAX_BODY_BYTES = 16 << 20  # a 128k-token prompt is ~0.5 MB of text, ~1 MB as token ids
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 256  # prompts in one /v1/completions batch: each is an engine request (times n)
MAX_STOP_STRINGS = 64  # each is checked after every token
MAX_TOOLS = 128  # OpenAI's
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
def _whole_number(value: Any) -> Any:
    # JSON Schema's "integer" is any number without a fraction: 2.0 is one (clients and
    # schema-driven tools send it), 2.5 and "2" are not (strict validation rejects them).
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """A JSON integer within `bounds` (pydantic's ge, le, ...)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[integer(ge=0)], Field(min_length=1)]
Prompt = Annotated[
    NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)],
    _one_of(f"a non-empty string, a list of them, a list of token ids (>= 0), or a list of those "
            f"(at most {MAX_PROMPTS} prompts)"),
]


class RequestBody(BaseModel):
    """JSON types as the schema says (2 is no string, "2" no number, NaN no number). Fields
    qrun has no use for (metadata, service_tier, ...) are ignored, as OpenAI's clients send them.
    Null means "not set": the field takes its default (so the schema admits null throughout)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(RequestBody):
    include_usage: bool | None = Field(False, description="end the stream with a chunk carrying the usage")


JsonSchema = dict[str, Any] | bool


class JsonSchemaFormat(RequestBody):
    name: str | None = Field(None, description="ignored")
    description: str | None = Field(None, description="ignored")
    json_schema: JsonSchema | None = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: bool | None = Field(None, description="ignored: the output always follows the schema")


class ResponseFormat(RequestBody):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object: {"name", "schema", "strict"}')
        return self


class StructuredOutputs(RequestBody):
    """vLLM's structured_outputs: exactly one of these."""

    json_: JsonSchema | str | None = Field(None, alias="json", description="a JSON schema, or its JSON text")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = Field(None, description="a Lark grammar, or GBNF as llama.cpp writes it")
    json_object: bool | None = None


class SamplingRequest(RequestBody):
    """The fields both endpoints take: OpenAI's, and qrun's extensions with vLLM's names
    (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output, ignore_eos)."""

    model: str | None = Field(None, description="ignored: the server serves one model")
    user: str | None = Field(None, description="ignored")
    max_tokens: integer(ge=1) | None = Field(
        None, description="default: all the model's context (or the KV cache) leaves after the prompt")
    max_completion_tokens: integer(ge=1) | None = Field(
        None, description="the newer name of max_tokens; wins over it")
    min_tokens: integer(ge=0) | None = Field(0, description="at most max_tokens")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(1.0, description="0: greedy")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = 1.0
    top_k: Annotated[Literal[-1] | Annotated[int, Field(ge=1)], BeforeValidator(_whole_number),
                     _one_of("-1 (disabled) or an integer >= 1")] | None = -1
    min_p: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] | None = Field(1.0, description="1: none")
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    n: integer(ge=1, le=MAX_N) | None = Field(1, description="choices per prompt")
    seed: integer(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: Annotated[NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP_STRINGS)],
                    _one_of(f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")] | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description='token id (as a string) -> a bias in [-100, 100] added to its logit: {"50256": -100}')
    stop_token_ids: Annotated[list[integer(ge=0)], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="token ids that end a choice (EOS aside)")
    include_stop_str_in_output: bool | None = Field(False, description="keep the stop string that ended a choice")
    ignore_eos: bool | None = False
    stream: bool | None = Field(False, description="answer as server-sent events")
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's form of a constrained output")
    guided_json: JsonSchema | str | None = Field(None, description="the older name of structured_outputs.json")
    guided_regex: NonEmptyStr | None = Field(None, description="the older name of structured_outputs.regex")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = Field(
        None, description="the older name of structured_outputs.choice")
    guided_grammar: NonEmptyStr | None = Field(None, description="the older name of structured_outputs.grammar")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's SamplingParams; `constraint` (a tool choice's) when the body sets none."""
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, n=self.n, stop=self.stop,
                seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logprobs=logprobs, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.logit_bias,
                structured_outputs=self.structured_outputs_params() or constraint)
        except InvalidSamplingParam as err:  # what no field says alone: min_tokens above max_tokens
            raise ApiError(400, str(err), err.name) from None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the body asks for, by whichever name; a 400 if it names two."""
        given = {name: value for name, value in (
            ("response_format", self.response_format), ("structured_outputs", self.structured_outputs),
            ("guided_json", self.guided_json), ("guided_regex", self.guided_regex),
            ("guided_choice", self.guided_choice), ("guided_grammar", self.guided_grammar)) if value is not None}
        if len(given) > 1:
            raise ApiError(400, f"{' and '.join(given)} both constrain the output: give one", list(given)[1])
        if not given:
            return None
        name, value = next(iter(given.items()))
        if name == "response_format":
            return StructuredOutputsParams.from_response_format(value.model_dump(by_alias=True, exclude_none=True))
        if name == "structured_outputs":
            return StructuredOutputsParams(**{k.rstrip("_"): v for k, v in value.model_dump().items()
                                              if v is not None and v is not False})
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions."""

    prompt: Prompt = Field(description="one prompt or a batch; each gets n choices")
    max_tokens: integer(ge=1) | None = COMPLETION_MAX_TOKENS
    echo: bool | None = Field(False, description="put the prompt before each choice's text")
    best_of: integer(ge=1, le=1) | None = Field(
        None, description="only 1: qrun returns every one of the n choices it samples")
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
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


class FunctionDefinition(RequestBody):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = Field(None, description="ignored: required and named tool choices always follow it")


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestBody):
    name: NonEmptyStr


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without")
    logprobs: bool | None = Field(False, description="log probabilities of the sampled tokens")
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
        0, description="with logprobs: this many alternatives per token")
