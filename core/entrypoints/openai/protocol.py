"""OpenAI request bodies and the error body every failure answers with.

Bodies are parsed strictly: a wrong JSON type or an unknown field is an error (422), never a coercion or
a silent drop. Values are checked after parsing (400), by SamplingParams where it can.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share; None = the OpenAI default."""

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end-user id; OpenAI uses it for abuse checks, turnout for nothing
    # OpenAI fields turnout does not implement: accepted at their neutral values only
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | None = None
    response_format: dict[str, Any] | None = None


EXPECTED = {  # union-typed fields: what to say instead of pydantic's one line per alternative
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None


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
    return OpenAIError(422, f"'{param}': {err['msg']}", param=param, code="invalid_type")
