"""OpenAI request parsing for the worker: JSON body -> a validated GenerateRequest, or an ApiError.

Accepts OpenAI's fields plus the vLLM extensions clients rely on (top_k, ignore_eos,
stop_token_ids, priority, return_token_ids, continue_final_message, add_generation_prompt).
Unknown fields are ignored, as OpenAI and vLLM do; known fields with a wrong type or value get a
400 naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from worker.engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error returned to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What a completions or chat request asks the engine for, before tokenization of chats."""

    kind: str  # "completion" or "chat"
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...] | None
    sampling: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    echo: bool
    priority: int
    add_generation_prompt: bool
    continue_final_message: bool
    model: str | None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def parse_completion(data: dict[str, Any], header_priority: int | None = None) -> GenerateRequest:
    text, token_ids = _prompt(data.get("prompt"))
    if _get(data, "echo", bool, False):
        raise ApiError(400, "echo is not supported", param="echo")
    return _build(data, "completion", header_priority, prompt_text=text, prompt_token_ids=token_ids,
                  default_max_tokens=16)


def parse_chat(data: dict[str, Any], header_priority: int | None = None) -> GenerateRequest:
    messages = _messages(data.get("messages"))
    if data.get("tools"):
        raise ApiError(400, "tools are not supported by this worker", param="tools")
    continue_final = _get(data, "continue_final_message", bool, False)
    add_generation_prompt = _get(data, "add_generation_prompt", bool, not continue_final)
    if continue_final and messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    if continue_final and add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="add_generation_prompt")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    data = {**data, "max_tokens": max_tokens}
    return _build(data, "chat", header_priority, messages=messages, default_max_tokens=None,
                  add_generation_prompt=add_generation_prompt, continue_final_message=continue_final)


def _build(data: dict[str, Any], kind: str, header_priority: int | None, *, default_max_tokens: int | None,
           prompt_text: str | None = None, prompt_token_ids: tuple[int, ...] | None = None,
           messages: tuple[dict[str, Any], ...] | None = None, add_generation_prompt: bool = True,
           continue_final_message: bool = False) -> GenerateRequest:
    if _get(data, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    for unsupported in ("logprobs", "top_logprobs", "best_of", "logit_bias"):
        if data.get(unsupported) not in (None, False, 1 if unsupported == "best_of" else None):
            raise ApiError(400, f"{unsupported} is not supported", param=unsupported)
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _get(data, penalty, float, 0.0) != 0.0:
            raise ApiError(400, f"{penalty} is not supported (only 0)", param=penalty)
    max_tokens = _get(data, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    stream_options = _get(data, "stream_options", dict, None) or {}
    stream = _get(data, "stream", bool, False)
    if stream_options and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    priority = _get(data, "priority", int, header_priority if header_priority is not None else 0)
    return GenerateRequest(
        kind=kind,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        sampling=_sampling(data, max_tokens if max_tokens is not None else (default_max_tokens or 1)),
        max_tokens_given=max_tokens is not None or default_max_tokens is not None,
        stream=stream,
        include_usage=_get(stream_options, "include_usage", bool, False, "stream_options.include_usage"),
        continuous_usage=_get(stream_options, "continuous_usage_stats", bool, False,
                              "stream_options.continuous_usage_stats"),
        return_token_ids=_get(data, "return_token_ids", bool, False),
        echo=False,
        priority=priority,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        model=_get(data, "model", str, None),
    )


def _sampling(data: dict[str, Any], max_tokens: int) -> SamplingParams:
    temperature = _get(data, "temperature", float, 1.0)
    top_p = _get(data, "top_p", float, 1.0)
    top_k = _get(data, "top_k", int, None)
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if top_k is not None and top_k in (0, -1):
        top_k = None  # vLLM: 0 / -1 mean "no top-k"
    if top_k is not None and top_k < 1:
        raise ApiError(400, f"top_k must be >= 1 (or -1 to disable), got {top_k}", param="top_k")
    stop = data.get("stop")
    stop_strings = (stop,) if isinstance(stop, str) else tuple(_list_of(stop, str, "stop") or ())
    if len(stop_strings) > MAX_STOP_STRINGS or any(not s for s in stop_strings):
        raise ApiError(400, f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=_get(data, "seed", int, None),
        max_tokens=max_tokens,
        stop=stop_strings,
        stop_token_ids=tuple(_list_of(data.get("stop_token_ids"), int, "stop_token_ids") or ()),
        ignore_eos=_get(data, "ignore_eos", bool, False),
        include_stop_str_in_output=_get(data, "include_stop_str_in_output", bool, False),
    )


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """A string, a one-element list of strings, a list of token ids, or a one-element list of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise ApiError(400, "prompt token ids must be >= 0", param="prompt")
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "only one prompt per request is supported", param="prompt")
    raise ApiError(400, "prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


def _messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role must be one of system, developer, user, assistant, tool",
                           param=f"messages[{i}].role")
        result.append({**message, "content": _content_text(message.get("content"), i)})
    return tuple(result)


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_CHECKS: dict[type, Callable[[Any], bool]] = {
    int: _is_int,
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    bool: lambda v: isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    dict: lambda v: isinstance(v, dict),
}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", dict: "an object"}


def _get(data: dict[str, Any], key: str, tp: type, default: Any, param: str | None = None) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if not _CHECKS[tp](value):
        name = param or key
        raise ApiError(400, f"{name} must be {_TYPE_NAMES[tp]}, got {json.dumps(value)[:50]}", param=name)
    return float(value) if tp is float else value


def _list_of(value: Any, tp: type, name: str) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(_CHECKS[tp](v) for v in value):
        raise ApiError(400, f"{name} must be a list of {'strings' if tp is str else 'integers'}", param=name)
    return value
