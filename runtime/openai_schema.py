"""Request and response bodies of the OpenAI-compatible API that strata-serve speaks (docs/commands.md,
strata-serve). Requests are validated here: a field the server cannot honour (n > 1, logprobs, penalties, tools)
is refused with one sentence rather than silently ignored; fields it has no use for (user, metadata) are ignored."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 16           # OpenAI allows 4; a few more cost nothing
MAX_STOP_CHARS = 256


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off (vLLM's convention)")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if items is None:
            return v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("must be a string or a list of strings")
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(items)}")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _supported(self) -> _Request:
        if self.n != 1:
            raise ValueError("n must be 1: this server makes one completion per request")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported; leave it out or set it to 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported; leave it out")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(..., description="text, or token ids; a list holding one string is that string")
    max_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v
        if isinstance(v, list) and v and all(isinstance(x, str | list) for x in v):
            raise ValueError("one prompt per request: this server does not batch prompts")
        raise ValueError("must be a string or a list of token ids")

    @model_validator(mode="after")
    def _completion_supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported; leave it out")
        if self.logprobs:
            raise ValueError("logprobs are not supported; leave them out")
        if self.best_of not in (None, 1):
            raise ValueError("best_of must be 1")
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")      # name, tool_call_id, reasoning_content reach the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            texts = []
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
                texts.append(part["text"])
            return "".join(texts)
        return v

    def for_template(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        d.setdefault("content", "")
        return d


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="extra template variables, e.g. "
                                                        "{\"enable_thinking\": false}")

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatRequest:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs are not supported; leave them out")
        if self.tools:
            raise ValueError("tools (function calling) are not supported; leave them out")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ------------------------------------------------------------------------------------------------ responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class StrataStats(BaseModel):
    """The speculative decoding of one response: how many verify windows, how many drafted tokens were proposed
    and accepted, tokens per window, and the speed of the decode."""
    drafter: str
    device: str
    windows: int
    proposed: int
    accepted: int
    acceptance: float | None = Field(description="accepted / proposed (None when nothing was proposed)")
    tokens_per_window: float | None = Field(description="tokens made per verify window (the first token comes "
                                                         "from the prompt pass)")
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    decode_tok_s: float
    queue_s: float
    stop_reason: str
    fallbacks: list[str] = Field(default_factory=list, description="fast paths this server gave up for slower ones "
                                 "computing the same (a kernel that did not build on this GPU, a CUDA graph that "
                                 "did not capture), one line each: why a run is slower than it should be")


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    strata: StrataStats | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    strata: StrataStats | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    strata: StrataStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "strata"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: the official clients read `error.message` into their exception."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
