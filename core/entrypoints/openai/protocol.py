"""OpenAI request bodies and the error body every failure answers with.

Bodies are parsed strictly: a wrong JSON type or an unknown field is an error (422), never a coercion or
a silent drop. Values are checked after parsing (400), by SamplingParams where it can; here, that n <= 128
and that every integer of the body, free-form JSON included, fits in int64 (C, numpy, torch and msgpack
take no wider). The response models at the end document what the handlers answer (in /openapi.json).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class OpenAIError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_N = 128  # OpenAI's bound on n: each choice is an engine request
# The documented ranges: parse() holds every integer to int64; the lower bounds of token ids and n are the
# engine's and SamplingParams' checks, with their own messages.
Int = Annotated[int, Field(json_schema_extra={"minimum": INT64_MIN, "maximum": INT64_MAX})]
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0, "maximum": INT64_MAX})]
N = Annotated[int, Field(le=MAX_N, json_schema_extra={"minimum": 1})]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: the schema the output must validate against."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` extra field: exactly one constraint on the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class _SamplingFields(_Strict):
    """Fields both endpoints share; None = the OpenAI default."""

    model: str | None = None
    n: N | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end-user id; OpenAI uses it for abuse checks, turnout for nothing
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # OpenAI fields turnout does not implement: accepted at their neutral values only
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    """A call an assistant message made: in an answer, and sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # role assistant
    tool_call_id: str | None = None  # role tool: the call this message answers


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


EXPECTED = {  # union-typed fields: what to say instead of pydantic's one line per alternative
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "response_format": '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", ...}',
}


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    if (wide := _wide_int(req)) is not None:
        param, where, value = wide
        msg = f"'{where}' is {value}, beyond 64-bit integers; the engine cannot take it"
        raise OpenAIError(400, msg, param=param)
    return req


def _validation_error(e: ValidationError) -> OpenAIError:
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    if err["type"] == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json")
    if not loc:
        return OpenAIError(400, "the body must be a JSON object", code="invalid_json")
    path = []
    for x in loc:
        path.append(x)
        if x in EXPECTED:  # what follows names one of the union's members
            break
    param = ".".join(path)
    if err["type"] == "extra_forbidden":
        msg = f"unknown field '{param}'; turnout does not take it (see the OpenAI API reference)"
        return OpenAIError(422, msg, param=param, code="unknown_field")
    if err["type"] == "missing":
        return OpenAIError(422, f"'{param}' is required", param=param, code="missing_field")
    if path[-1] in EXPECTED:
        return OpenAIError(422, f"'{param}' must be {EXPECTED[path[-1]]}", param=param, code="invalid_type")
    if err["type"] == "less_than_equal":  # a value check, as SamplingParams' are
        return OpenAIError(400, f"'{param}' must be <= {err['ctx']['le']}, got {err['input']}", param=param)
    return OpenAIError(422, f"'{param}': {err['msg']}", param=param, code="invalid_type")


def _wide_int(node: Any, param: str = "", where: str = "") -> tuple[str, str, int] | None:
    """The first integer of a parsed body beyond int64, anywhere, free-form JSON (a schema, a tool's
    parameters) included: (the field that holds it, where it is, its value); None if there is none."""
    if isinstance(node, BaseModel):
        fields = type(node).model_fields.items()
        items = [(f.alias or name, getattr(node, name), True) for name, f in fields]
    elif isinstance(node, (dict, list)):
        items = [(k, v, False) for k, v in (node.items() if isinstance(node, dict) else enumerate(node))]
    else:
        return (param, where, node) if type(node) is int and not INT64_MIN <= node <= INT64_MAX else None
    for key, value, is_field in items:
        at = f"{where}.{key}" if where else str(key)
        if (hit := _wide_int(value, at if is_field else param, at)) is not None:
            return hit
    return None


# ---- response bodies: what the handlers answer, as documented in /openapi.json (they build plain dicts) ----
class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error, authentication_error, not_found_error, server_error, ...
    param: str | None  # the request field at fault, dotted ("messages.0.role")
    code: str | None  # invalid_json, unknown_field, missing_field, invalid_type, model_not_found, ...


class ErrorResponse(BaseModel):
    """Every error's body; also the `data:` event that ends a stream that failed part way."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, logprob, the top N {text: logprob} and where its text starts."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None  # None until a stream's choice ends


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One `data:` event of a stream: a choice's new text or its end; with stream_options.include_usage
    every chunk has usage null, and a last one has no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is tool calls only
    tool_calls: list[ToolCall] | None = None  # the same shape as a request's assistant message holds


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's text as UTF-8


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


ChatFinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatFunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None  # the next piece of the arguments' JSON text


class ChatToolCallDelta(BaseModel):
    """A piece of a tool call: the first names it (id, type, function.name), the rest add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChatFunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in each choice's first chunk
    content: str | None = None
    tool_calls: list[ChatToolCallDelta] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionStreamResponse(BaseModel):
    """One `data:` event of a stream: first each choice's role, then new text or tool-call pieces, then
    its end; with stream_options.include_usage every chunk has usage null, and a last one has no choices
    and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str
