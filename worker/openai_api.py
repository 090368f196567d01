"""OpenAI request parsing for the worker: JSON body -> a validated GenerateRequest, or an ApiError.

Accepts OpenAI's fields plus the vLLM extensions clients rely on (top_k, ignore_eos,
stop_token_ids, return_token_ids, continue_final_message, add_generation_prompt).
Unknown fields are ignored, as OpenAI and vLLM do; known fields with a wrong type or value, or
asking for a feature this worker lacks (tools, echo, guided decoding...), get a 400 naming the field.
Logprobs are asked as each endpoint asks them: a chat's `logprobs: true` with `top_logprobs: N`, a
completion's `logprobs: N` (N at most MAX_LOGPROBS); both become SamplingParams.logprobs = N.

Priority comes only from the x-priority header, which the gateway sets to the priority it admitted;
the body's `priority` (vLLM's field) is accepted and ignored, since a client chose it.

Limits (a 400 naming the field beyond them): at most MAX_STOP_STRINGS stop strings of at most
MAX_STOP_STRING_CHARS characters each (the per-token stop check costs the longest one), at most
MAX_STOP_TOKEN_IDS stop_token_ids; a body nested deeper than the JSON parser's recursion limit
(about 1,000 levels) is a 400 too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from kvgate.api_error import ApiError
from worker.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's bound on logit_bias entries
MAX_CHOICES = 128  # OpenAI's bound on n


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What a completions or chat request asks the engine for, before tokenization of chats."""

    kind: str  # "completion" or "chat"
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    messages: tuple[dict[str, Any], ...] | None
    sampling: SamplingParams
    max_tokens_given: bool
    max_tokens_param: str  # the name the client used: max_tokens or max_completion_tokens
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    echo: bool
    priority: int
    add_generation_prompt: bool
    continue_final_message: bool
    model: str | None
    sampling_given: frozenset[str] = frozenset()  # the SAMPLING_PARAMS the body set (not defaulted)
    n: int = 1  # choices: each an engine request of its own (seeded ones with seed + its index, as vLLM)


# Sampling params a request's span names when the client set them (gen_ai.request.*, OpenTelemetry's names).
SAMPLING_PARAMS = ("temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty")


def _unset(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    """None, false or 0: the values that ask for nothing."""
    return value is None or value is False or (_is_int(value) and value == 0)


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


# Params this worker cannot honour: (accepts, what it accepts); only values that ask for nothing pass.
_UNSUPPORTED_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v is None or (_is_int(v) and v == 1), "1"),
    "use_beam_search": (_off, ""),
    "guided_json": (_unset, ""),
    "guided_regex": (_unset, ""),
    "guided_choice": (_unset, ""),
    "guided_grammar": (_unset, ""),
    "structured_outputs": (_unset, ""),
    "echo": (_off, ""),
    "prompt_logprobs": (_unset, ""),
    "truncate_prompt_tokens": (_unset, ""),
    "bad_words": (_empty, ""),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_empty, ""),
    "functions": (_empty, ""),
    "function_call": (lambda v: v in (None, "none"), '"none"'),
    "modalities": (lambda v: v is None or v == ["text"], '["text"]'),
    "audio": (_unset, ""),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (lambda v: v is None or v == "", ""),
}


def parse_completion(data: dict[str, Any], header_priority: int | None = None) -> GenerateRequest:
    text, token_ids = _prompt(data.get("prompt"))
    _reject_unsupported(data, _UNSUPPORTED_COMPLETION)
    return _build(data, "completion", header_priority, prompt_text=text, prompt_token_ids=token_ids,
                  default_max_tokens=16, logprobs=_num_logprobs(data, "logprobs"))


def parse_chat(data: dict[str, Any], header_priority: int | None = None) -> GenerateRequest:
    messages = _messages(data.get("messages"))
    _reject_unsupported(data, _UNSUPPORTED_CHAT)
    continue_final = _get(data, "continue_final_message", bool, False)
    add_generation_prompt = _get(data, "add_generation_prompt", bool, not continue_final)
    if continue_final and messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    if continue_final and add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="add_generation_prompt")
    max_tokens_param = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    return _build(data, "chat", header_priority, messages=messages, default_max_tokens=None,
                  max_tokens_param=max_tokens_param, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final, logprobs=_chat_logprobs(data))


def _build(data: dict[str, Any], kind: str, header_priority: int | None, *, default_max_tokens: int | None,
           prompt_text: str | None = None, prompt_token_ids: tuple[int, ...] | None = None,
           messages: tuple[dict[str, Any], ...] | None = None, max_tokens_param: str = "max_tokens",
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           logprobs: int | None = None) -> GenerateRequest:
    n = _get(data, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {n}", param="n")
    _reject_unsupported(data, _UNSUPPORTED_COMMON)
    _check_response_format(data.get("response_format"))
    max_tokens = _get(data, max_tokens_param, int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param)
    stream_options = _get(data, "stream_options", dict, None)
    stream = _get(data, "stream", bool, False)
    if stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    stream_options = stream_options or {}
    priority = header_priority if header_priority is not None else 0  # never the body's: a client chose it
    return GenerateRequest(
        kind=kind,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        sampling=_sampling(data, max_tokens, default_max_tokens, max_tokens_param, logprobs),
        max_tokens_given=max_tokens is not None or default_max_tokens is not None,
        max_tokens_param=max_tokens_param,
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
        sampling_given=frozenset(p for p in SAMPLING_PARAMS if data.get(p) is not None),
        n=n,
    )


def _reject_unsupported(data: dict[str, Any], table: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """400 for a param of table set to a value other than the ones that ask for nothing."""
    for param, (accepts, accepted) in table.items():
        if not accepts(data.get(param)):
            raise ApiError(400, f"{param} is not supported" + (f" (only {accepted})" if accepted else ""),
                           param=param)


def _check_response_format(response_format: Any) -> None:
    """Only plain text: json_object and json_schema need guided decoding, which this worker lacks."""
    if response_format is None:
        return
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ApiError(400, 'response_format must be an object with a string "type"', param="response_format")
    if response_format["type"] != "text":
        raise ApiError(400, f"response_format type {json.dumps(response_format['type'])[:50]} is not supported "
                       '(only "text")', param="response_format")


def _chat_logprobs(data: dict[str, Any]) -> int | None:
    """A chat's logprobs (a boolean) and top_logprobs (how many alternatives) as one number, or None."""
    wanted = _get(data, "logprobs", bool, False)
    num_top = _num_logprobs(data, "top_logprobs")
    if num_top and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    return (num_top or 0) if wanted else None


def _num_logprobs(data: dict[str, Any], param: str) -> int | None:
    number = _get(data, param, int, None)
    if number is not None and not 0 <= number <= MAX_LOGPROBS:
        raise ApiError(400, f"{param} must be in [0, {MAX_LOGPROBS}], got {number}", param=param)
    return number


def _sampling(data: dict[str, Any], max_tokens: int | None, default_max_tokens: int | None, max_tokens_param: str,
              logprobs: int | None) -> SamplingParams:
    """The sampling params; without max_tokens (a chat's), max_tokens is a placeholder that
    server._fit_context replaces with the room the prompt leaves (checking min_tokens against it)."""
    min_tokens = _get(data, "min_tokens", int, 0)
    if min_tokens < 0:
        raise ApiError(400, f"min_tokens must be >= 0, got {min_tokens}", param="min_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be at most {max_tokens_param} ({max_tokens})",
                       param="min_tokens")
    if max_tokens is None:
        max_tokens = max(1, min_tokens)
    temperature = _get(data, "temperature", float, 1.0)
    top_p = _get(data, "top_p", float, 1.0)
    top_k = _get(data, "top_k", int, None)
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    min_p = _get(data, "min_p", float, 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise ApiError(400, f"min_p must be in [0, 1], got {min_p}", param="min_p")
    allowed_token_ids = tuple(_list_of(data.get("allowed_token_ids"), int, "allowed_token_ids") or ())
    if any(token < 0 for token in allowed_token_ids):
        raise ApiError(400, "allowed_token_ids must be >= 0", param="allowed_token_ids")
    if top_k is not None and top_k in (0, -1):
        top_k = None  # vLLM: 0 / -1 mean "no top-k"
    if top_k is not None and top_k < 1:
        raise ApiError(400, f"top_k must be >= 1 (or -1 to disable), got {top_k}", param="top_k")
    penalties = {param: _get(data, param, float, 0.0) for param in ("presence_penalty", "frequency_penalty")}
    for param, value in penalties.items():
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise ApiError(400, f"{param} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", param=param)
    repetition_penalty = _get(data, "repetition_penalty", float, 1.0)
    if not repetition_penalty > 0:
        raise ApiError(400, f"repetition_penalty must be > 0, got {repetition_penalty}", param="repetition_penalty")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=_get(data, "seed", int, None),
        max_tokens=max_tokens,
        stop=_stop_strings(data.get("stop")),
        stop_token_ids=_stop_token_ids(data.get("stop_token_ids")),
        ignore_eos=_get(data, "ignore_eos", bool, False),
        include_stop_str_in_output=_get(data, "include_stop_str_in_output", bool, False),
        logprobs=logprobs,
        repetition_penalty=repetition_penalty,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(data.get("logit_bias")),
        allowed_token_ids=allowed_token_ids,
        skip_special_tokens=_get(data, "skip_special_tokens", bool, True),
        **penalties,
    )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to a bias in [-100, 100], at most MAX_LOGIT_BIAS_TOKENS of
    them (the server checks each id against the model's vocabulary)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ApiError(400, "logit_bias must be an object mapping token ids to biases", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise ApiError(400, f"logit_bias must have at most {MAX_LOGIT_BIAS_TOKENS} entries", param="logit_bias")
    biases = []
    for key, bias in value.items():
        in_range = _CHECKS[float](bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        if not (key.isascii() and key.isdigit() and in_range):
            raise ApiError(400, f"logit_bias maps token ids to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; "
                           f"got {json.dumps({key: bias})[:60]}", param="logit_bias")
        biases.append((int(key), float(bias)))
    return tuple(biases)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    """A string or a list of at most MAX_STOP_STRINGS strings of at most MAX_STOP_STRING_CHARS each."""
    stop_list = [stop] if isinstance(stop, str) else _list_of(stop, str, "stop") or []
    stop_strings = tuple(s for s in stop_list if s)  # an empty stop string can never match: ignored
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop must be at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop_strings):
        raise ApiError(400, f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters", param="stop")
    return stop_strings


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    """A list of at most MAX_STOP_TOKEN_IDS integers (counted before each is looked at)."""
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} token ids",
                       param="stop_token_ids")
    return tuple(_list_of(value, int, "stop_token_ids") or ())


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


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    return tuple(_message(message, i) for i, message in enumerate(messages))


def _message(message: Any, i: int) -> dict[str, Any]:
    """The message as the template sees it: content as text, and developer (OpenAI's newer name for
    system instructions) as system. router/tokenization.py renders messages the same way."""
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
    role = message.get("role")
    if role is None:
        raise ApiError(400, f"messages[{i}].role is required", param=f"messages[{i}].role")
    if role not in _ROLES:
        raise ApiError(400, f"messages[{i}].role must be one of {', '.join(_ROLES)}", param=f"messages[{i}].role")
    content = message.get("content")
    calls = role == "assistant" and (message.get("tool_calls") or message.get("function_call"))
    if content is None and not calls:
        raise ApiError(400, f"messages[{i}].content is required", param=f"messages[{i}].content")
    return {**message, "role": "system" if role == "developer" else role, "content": _content_text(content, i)}


def _content_text(content: Any, i: int) -> str:
    """A string, None (an assistant message with tool calls) or text parts joined by newlines, as vLLM does."""
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
        return "\n".join(parts)
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
