"""Request parsing (worker/openai_api.py): what is accepted, and the 400 a client gets for the rest."""

from __future__ import annotations

from typing import Any

import pytest

from worker.openai_api import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, ApiError, parse_chat,
                               parse_completion)

USER = [{"role": "user", "content": "What is 2+2?"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "hi", **fields}


def rejection(parse, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


UNSUPPORTED = [
    ("response-format-json-object", parse_chat, chat(response_format={"type": "json_object"}), "response_format"),
    ("response-format-json-schema", parse_chat,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}), "response_format"),
    ("response-format-other-type", parse_chat, chat(response_format={"type": "yaml"}), "response_format"),
    ("response-format-not-object", parse_chat, chat(response_format="json"), "response_format"),
    ("response-format-without-type", parse_chat, chat(response_format={}), "response_format"),
    ("response-format-on-completions", parse_completion, completion(response_format={"type": "json_object"}),
     "response_format"),
    ("functions", parse_chat, chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
    ("function-call", parse_chat, chat(function_call={"name": "f"}), "function_call"),
    ("function-call-auto", parse_chat, chat(function_call="auto"), "function_call"),
    ("tools", parse_chat, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("suffix", parse_completion, completion(suffix="end"), "suffix"),
    ("modalities-audio", parse_chat, chat(modalities=["text", "audio"]), "modalities"),
    ("audio", parse_chat, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("guided-json", parse_chat, chat(guided_json={"type": "object"}), "guided_json"),
    ("guided-regex", parse_completion, completion(guided_regex="[0-9]+"), "guided_regex"),
    ("guided-choice", parse_chat, chat(guided_choice=["yes", "no"]), "guided_choice"),
    ("guided-grammar", parse_chat, chat(guided_grammar="root ::= 'a'"), "guided_grammar"),
    ("structured-outputs", parse_chat, chat(structured_outputs={"choice": ["a"]}), "structured_outputs"),
    ("repetition-penalty-zero", parse_chat, chat(repetition_penalty=0), "repetition_penalty"),
    ("min-tokens-negative", parse_completion, completion(min_tokens=-1), "min_tokens"),
    ("min-tokens-past-max-tokens", parse_completion, completion(min_tokens=5, max_tokens=4), "min_tokens"),
    ("min-tokens-past-the-default-max-tokens", parse_completion, completion(min_tokens=17), "min_tokens"),
    ("min-tokens-float", parse_chat, chat(min_tokens=2.0), "min_tokens"),
    ("use-beam-search", parse_chat, chat(use_beam_search=True), "use_beam_search"),
    ("echo-on-chat", parse_chat, chat(echo=True), "echo"),
    ("echo-on-completions", parse_completion, completion(echo=True), "echo"),
    ("logit-bias-not-object", parse_chat, chat(logit_bias=[5, 10]), "logit_bias"),
    ("logit-bias-key-not-an-id", parse_chat, chat(logit_bias={"five": 10}), "logit_bias"),
    ("logit-bias-negative-id", parse_chat, chat(logit_bias={"-5": 10}), "logit_bias"),
    ("logit-bias-past-100", parse_chat, chat(logit_bias={"5": 101}), "logit_bias"),
    ("logit-bias-not-a-number", parse_chat, chat(logit_bias={"5": "10"}), "logit_bias"),
    ("logit-bias-too-many", parse_chat, chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    ("chat-logprobs-not-bool", parse_chat, chat(logprobs=2), "logprobs"),
    ("top-logprobs-without-logprobs", parse_chat, chat(top_logprobs=2), "top_logprobs"),
    ("top-logprobs-past-the-bound", parse_chat, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-negative", parse_chat, chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("completion-logprobs-bool", parse_completion, completion(logprobs=True), "logprobs"),
    ("completion-logprobs-past-the-bound", parse_completion, completion(logprobs=21), "logprobs"),
    ("presence-penalty-past-2", parse_chat, chat(presence_penalty=2.5), "presence_penalty"),
    ("min-p-past-1", parse_chat, chat(min_p=1.5), "min_p"),
    ("n-zero", parse_chat, chat(n=0), "n"),
    ("n-past-128", parse_completion, completion(n=129), "n"),
    ("n-float", parse_completion, completion(n=2.0), "n"),
    ("allowed-token-ids-negative", parse_chat, chat(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    ("allowed-token-ids-not-a-list", parse_completion, completion(allowed_token_ids=3), "allowed_token_ids"),
    ("skip-special-tokens-not-bool", parse_completion, completion(skip_special_tokens="no"), "skip_special_tokens"),
    ("prompt-logprobs", parse_completion, completion(prompt_logprobs=1), "prompt_logprobs"),
    ("truncate-prompt-tokens", parse_completion, completion(truncate_prompt_tokens=10), "truncate_prompt_tokens"),
    ("bad-words", parse_chat, chat(bad_words=["foo"]), "bad_words"),
    ("frequency-penalty-past-minus-2", parse_completion, completion(frequency_penalty=-2.01), "frequency_penalty"),
    ("frequency-penalty-string", parse_completion, completion(frequency_penalty="1"), "frequency_penalty"),
    ("stream-options-without-stream", parse_chat, chat(stream_options={"include_usage": True}), "stream_options"),
    ("empty-stream-options-without-stream", parse_completion, completion(stream_options={}), "stream_options"),
    ("stream-options-stream-false", parse_chat, chat(stream=False, stream_options={}), "stream_options"),
    ("stream-options-not-object", parse_chat, chat(stream=True, stream_options=[True]), "stream_options"),
    ("include-usage-not-bool", parse_chat, chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),
]


@pytest.mark.parametrize(("parse", "body", "param"), [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_or_malformed_param_gets_a_400_naming_it(parse, body, param):
    error = rejection(parse, body)
    assert error.param == param
    assert param in error.message


def test_stream_options_without_stream_says_it_needs_stream():
    error = rejection(parse_chat, chat(stream_options={"include_usage": True}))
    assert error.message == "stream_options is only allowed when stream is true"


def test_json_response_format_names_the_type_it_cannot_honour():
    error = rejection(parse_chat, chat(response_format={"type": "json_object"}))
    assert '"json_object"' in error.message and "not supported" in error.message


NO_OPS = [
    ("response-format-text", parse_chat, chat(response_format={"type": "text"})),
    ("empty-logit-bias", parse_chat, chat(logit_bias={})),
    ("empty-suffix", parse_completion, completion(suffix="")),
    ("modalities-text", parse_chat, chat(modalities=["text"])),
    ("function-call-none", parse_chat, chat(function_call="none")),
    ("empty-functions-and-tools", parse_chat, chat(functions=[], tools=[])),
    ("null-guided-fields", parse_chat, chat(guided_json=None, guided_regex=None, structured_outputs=None)),
    ("neutral-penalties", parse_completion, completion(repetition_penalty=1, min_tokens=0, presence_penalty=0)),
    ("beam-search-off", parse_chat, chat(use_beam_search=False, echo=False)),
    ("stream-options-with-stream", parse_chat, chat(stream=True, stream_options={"include_usage": True})),
    ("unknown-field", parse_chat, chat(foo_bar={"anything": 1})),
    ("logprobs-off", parse_chat, chat(logprobs=False, top_logprobs=0)),
    ("unknown-field-completions", parse_completion, completion(foo_bar=[1, 2])),
]


@pytest.mark.parametrize(("parse", "body"), [c[1:] for c in NO_OPS], ids=[c[0] for c in NO_OPS])
def test_values_that_ask_for_nothing_and_unknown_fields_are_accepted(parse, body):
    assert parse(body).model == "tiny"


def test_penalties_min_tokens_and_logit_bias_reach_the_sampling_params():
    sampling = parse_chat(chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3, min_tokens=4,
                               logit_bias={"7": -100, "11": 2.5})).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.3)
    assert sampling.min_tokens == 4 and sampling.logit_bias == ((7, -100.0), (11, 2.5))
    assert sampling.adjusts_logits and not parse_chat(chat(presence_penalty=0, logit_bias={})).sampling.adjusts_logits
    assert parse_chat(chat(min_tokens=40)).sampling.max_tokens == 40  # a placeholder until the room is known
    assert (parse_chat(chat(n=4)).n, parse_chat(chat()).n) == (4, 1)
    more = parse_completion(completion(min_p=0.05, allowed_token_ids=[3, 5], skip_special_tokens=False)).sampling
    assert (more.min_p, more.allowed_token_ids, more.skip_special_tokens) == (0.05, (3, 5), False)
    assert more.adjusts_logits and parse_completion(completion()).sampling.skip_special_tokens


@pytest.mark.parametrize(("parse", "body", "expected"), [
    (parse_chat, chat(), None),
    (parse_chat, chat(logprobs=False), None),
    (parse_chat, chat(logprobs=True), 0),
    (parse_chat, chat(logprobs=True, top_logprobs=20), 20),
    (parse_completion, completion(), None),
    (parse_completion, completion(logprobs=0), 0),
    (parse_completion, completion(logprobs=5), 5),
    (parse_completion, completion(top_logprobs=3), None),  # not a completions field: ignored, as vLLM does
], ids=["chat-none", "chat-off", "chat-own-only", "chat-top-20", "completion-none", "completion-own-only",
        "completion-top-5", "completion-top-logprobs-ignored"])
def test_logprobs_are_asked_as_each_endpoint_asks_them(parse, body, expected):
    assert parse(body).sampling.logprobs == expected


def test_max_completion_tokens_zero_is_named_in_the_error():
    error = rejection(parse_chat, chat(max_completion_tokens=0))
    assert error.param == "max_completion_tokens"
    assert error.message == "max_completion_tokens must be at least 1, got 0"


def test_max_completion_tokens_of_the_wrong_type_is_named_in_the_error():
    assert rejection(parse_chat, chat(max_completion_tokens="5")).param == "max_completion_tokens"


def test_max_tokens_zero_still_names_max_tokens():
    assert rejection(parse_chat, chat(max_tokens=0)).param == "max_tokens"
    assert rejection(parse_completion, completion(max_tokens=0)).param == "max_tokens"


def test_max_completion_tokens_wins_over_max_tokens_and_is_remembered():
    req = parse_chat(chat(max_completion_tokens=7, max_tokens=3))
    assert req.sampling.max_tokens == 7 and req.max_tokens_param == "max_completion_tokens"
    assert parse_chat(chat(max_tokens=3)).max_tokens_param == "max_tokens"


@pytest.mark.parametrize(("stop", "expected"), [
    ("", ()),
    (["", "END"], ("END",)),
    ([""], ()),
    ("END", ("END",)),
], ids=["empty-string", "empty-in-list", "only-empty-in-list", "plain"])
def test_empty_stop_strings_are_ignored(stop, expected):
    assert parse_completion(completion(stop=stop)).sampling.stop == expected


def test_too_many_stop_strings_are_rejected():
    assert rejection(parse_completion, completion(stop=[f"s{i}" for i in range(17)])).param == "stop"


BAD_MESSAGES = [
    ("no-role", [{"content": "hi"}], "messages[0].role", "messages[0].role is required"),
    ("no-content", [{"role": "user"}], "messages[0].content", "messages[0].content is required"),
    ("null-content", [{"role": "system", "content": None}, *USER], "messages[0].content",
     "messages[0].content is required"),
    ("assistant-without-content-or-calls", [*USER, {"role": "assistant"}], "messages[1].content",
     "messages[1].content is required"),
    ("unknown-role", [{"role": "robot", "content": "x"}], "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, tool"),
    ("image-part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
     "messages[0].content", "messages[0].content: only text parts are supported"),
    ("number-content", [{"role": "user", "content": 123}], "messages[0].content",
     "messages[0].content must be a string or a list of text parts"),
]


@pytest.mark.parametrize(("messages", "param", "message"), [c[1:] for c in BAD_MESSAGES],
                         ids=[c[0] for c in BAD_MESSAGES])
def test_malformed_message_gets_a_clear_400(messages, param, message):
    error = rejection(parse_chat, chat(messages=messages))
    assert (error.param, error.message) == (param, message)


def test_assistant_message_with_tool_calls_may_omit_content():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    req = parse_chat(chat(messages=[*USER, {"role": "assistant", "tool_calls": calls}, *USER]))
    assert req.messages[1]["content"] == "" and req.messages[1]["tool_calls"] == calls


def test_text_parts_are_joined_with_newlines():
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]
    req = parse_chat(chat(messages=[{"role": "user", "content": parts}]))
    assert req.messages == ({"role": "user", "content": "What is\n2+2?"},)


def test_developer_role_is_rendered_as_system():
    req = parse_chat(chat(messages=[{"role": "developer", "content": "Be brief."}, *USER]))
    assert req.messages[0] == {"role": "system", "content": "Be brief."}


# ---- limits on stop conditions and body depth; priority only from the gateway ----------------


@pytest.mark.parametrize(("body", "param"), [
    (completion(stop="x" * (MAX_STOP_STRING_CHARS + 1)), "stop"),
    (completion(stop=["END", "y" * (MAX_STOP_STRING_CHARS + 1)]), "stop"),
    (completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
], ids=["one-long-stop-string", "long-stop-string-in-list", "too-many-stop-token-ids"])
def test_stop_conditions_beyond_the_limits_get_a_400_naming_the_field(body, param):
    error = rejection(parse_completion, body)
    assert error.param == param and "at most" in error.message


def test_stop_conditions_at_the_limits_are_accepted():
    stop = [chr(ord("a") + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]
    sampling = parse_completion(completion(stop=stop, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))).sampling
    assert sampling.stop == tuple(stop) and len(sampling.stop_token_ids) == MAX_STOP_TOKEN_IDS


@pytest.mark.parametrize(("parse", "body", "header_priority", "expected"), [
    (parse_completion, completion(priority=-100), None, 0),
    (parse_chat, chat(priority=-100), None, 0),
    (parse_completion, completion(priority=-100), 5, 5),
    (parse_completion, completion(priority="urgent"), 2, 2),
], ids=["completion-body-ignored", "chat-body-ignored", "header-wins-over-body", "any-body-value-accepted"])
def test_priority_comes_from_the_gateway_header_never_from_the_body(parse, body, header_priority, expected):
    assert parse(body, header_priority).priority == expected
