"""The request bodies `edgespec serve` accepts, as OpenAI defines them.

Strict types (no "yes" for a boolean, no "4" for an integer, no NaN): a client bug shows
up as a 422 naming the field, not as a guess. Fields OpenAI defines and edgespec does not
implement are refused when they would change the answer (tools, penalties, JSON mode...),
never silently ignored; fields that change nothing (user, metadata, store) are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgespec.spec.logprobs import MAX_TOP_LOGPROBS
from edgespec.stops import check_stops


class UnsupportedError(ValueError):
    """A well-formed request asking for something edgespec cannot do (a 400, not a 422)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class NotUnicode(ValueError):
    """A field holding a lone surrogate; `where` is the field as the API spells it (the
    server's 422 names it as its param)."""

    def __init__(self, where: str):
        super().__init__(f"{where or 'the body'} is not valid Unicode (it holds a lone "
                         "surrogate)")
        self.where = where


def _surrogate_free(value: Any, where: str = "") -> None:
    """JSON may spell lone surrogates ("\\ud800"); they are not text and cannot be
    tokenized or even written back in an error message."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise NotUnicode(where) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _surrogate_free(k, where)
            _surrogate_free(v, (f"{where}.{k}" if where else k) if isinstance(k, str)
                            else where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _surrogate_free(v, f"{where}[{i}]")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class ContentPart(Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class StreamOptions(Strict):
    include_usage: bool = False


StopField = (str | list[str] | None)


# sampling settings other servers take beyond OpenAI's, at the values that change nothing;
# any other value is refused, not ignored (unknown fields are ignored, as OpenAI's own)
FOREIGN_NEUTRAL: dict[str, Any] = {
    "min_p": 0, "typical_p": 1, "tfs_z": 1, "top_a": 0, "repetition_penalty": 1,
    "repeat_penalty": 1, "length_penalty": 1, "min_tokens": 0, "ignore_eos": False,
    "stop_token_ids": [], "mirostat": 0, "use_beam_search": False}


class Sampling(Strict):
    model_config = ConfigDict(extra="allow")  # the rest as Strict; FOREIGN_NEUTRAL reads it
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: StopField = None
    seed: int | None = Field(default=None, ge=0, lt=1 << 64)
    n: int | None = Field(default=None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    mode: Literal["ar", "spec", "lookup"] | None = None  # extension: the decoding mode
    # extension, as vLLM and llama.cpp's server take it: 0 or below (-1) is off
    top_k: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        _surrogate_free(data)
        return data

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> None:
        """Raise UnsupportedError for what would change the answer and is not done."""
        problem = check_stops(self.stops())
        if problem:
            raise UnsupportedError("stop", f"{problem}.")
        if (self.n or 1) != 1:
            raise UnsupportedError("n", "only n=1 is supported.")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedError("stream_options", "stream_options is only allowed when "
                                                     "stream is true.")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise UnsupportedError(name, f"{name} is not supported; leave it out or 0.")
        if self.logit_bias:
            raise UnsupportedError("logit_bias", "logit_bias is not supported.")
        for name, value in (self.model_extra or {}).items():
            if name in FOREIGN_NEUTRAL and value not in (None, FOREIGN_NEUTRAL[name]):
                raise UnsupportedError(name, f"{name} is not supported; leave it out.")


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # extension, as vLLM takes it: continue the last (assistant) message, not a new turn
    continue_final_message: bool = False

    def unsupported(self) -> None:
        super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedError("top_logprobs", "top_logprobs needs logprobs: true.")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise UnsupportedError("response_format", f"response_format '{kind}' is not "
                                   "supported; only plain text answers are.")
        if any(m != "text" for m in self.modalities or ()) or self.audio is not None:
            raise UnsupportedError("modalities", "only text output is supported; leave out "
                                                 "audio and give modalities ['text'] or none.")
        if self.tools or self.functions:
            raise UnsupportedError("tools", "tool calling is not supported.")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedError("tool_choice", "tool_choice needs tools, and tool calling "
                                                  "is not supported; leave it out.")
        for i, m in enumerate(self.messages):
            if m.tool_calls:
                raise UnsupportedError(f"messages[{i}].tool_calls",
                                       "tool calls are not supported.")
            if m.content is None:
                raise UnsupportedError(f"messages[{i}].content", "a message needs its "
                                       "content (a string or a list of text parts).")
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type != "text":
                    raise UnsupportedError(f"messages[{i}].content", "only text content "
                                           f"parts are supported, not '{part.type}'.")
                if not isinstance(part.text, str):
                    raise UnsupportedError(f"messages[{i}].content[{j}].text", "a text part "
                                           "needs its text (a string).")

    def conversation(self) -> list[dict[str, str]]:
        """Messages as chat templates take them: string content, `developer` is the
        system turn by another name (OpenAI's newer spelling)."""
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else "\n".join(
                p.text or "" for p in m.content or [])
            out.append({"role": "system" if m.role == "developer" else m.role,
                        "content": content})
        return out


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def unsupported(self) -> None:
        super().unsupported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1 and (
                not self.prompt or not isinstance(self.prompt[0], int)):
            raise UnsupportedError("prompt", "send one prompt per request (a string, a list "
                                             "of one string, or token ids).")
        if self.echo:
            raise UnsupportedError("echo", "echo is not supported.")
        if self.suffix:
            raise UnsupportedError("suffix", "suffix (insertion) is not supported.")
        if (self.best_of or 1) != 1:
            raise UnsupportedError("best_of", "only best_of=1 is supported.")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        return p if not p or isinstance(p[0], int) else p[0]
