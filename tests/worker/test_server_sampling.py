"""Sampling options as clients see them, the real `openai` SDK against a real worker process: logprobs
(a chat's `logprobs` and `top_logprobs`, a completion's `logprobs: N`, streamed and not; a sim worker
refuses them), logit_bias, min_tokens and the penalties."""

from __future__ import annotations

import openai
import pytest

from tests.processes import running_worker
from worker.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # every test runs against a worker process

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
WITH_IDS = {**GREEDY, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def eos_id(tiny_llama_dir) -> int:
    return load_tokenizer(tiny_llama_dir).eos_token_ids[0]


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with running_worker(tiny_llama_dir, "--block-size", "8", "--num-blocks", "128",
                        "--served-model-name", "tiny") as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as c:
            yield c


def test_chat_logprobs_list_each_token_with_its_likeliest_alternatives(client):
    result = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)

    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens == 8
    # the bytes join back into the text, though this random model's tokens split characters (so some tokens
    # read U+FFFD) and even put bytes together that are no UTF-8 (which the text shows as U+FFFD too)
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", "replace") == result.choices[0].message.content
    assert any("\ufffd" in entry.token for entry in content)
    for entry in content:
        assert entry.token == bytes(entry.bytes).decode("utf-8", "replace")
        assert len(entry.top_logprobs) == 3
        top_logprobs = [top.logprob for top in entry.top_logprobs]
        assert top_logprobs == sorted(top_logprobs, reverse=True)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)  # greedy
        assert entry.logprob <= 0


def test_chat_logprobs_without_top_logprobs_list_no_alternatives(client):
    result = client.chat.completions.create(messages=MESSAGES, logprobs=True, **GREEDY)
    assert [entry.top_logprobs for entry in result.choices[0].logprobs.content] == [[]] * 8


def test_a_chat_streamed_carries_each_tokens_logprobs_once_as_the_whole_answer_has_them(client):
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)

    chunks = list(client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True,
                                                 **GREEDY))

    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.choices[0].logprobs.content]


def test_completion_logprobs_have_tokens_offsets_and_the_sampled_token_among_the_top(client):
    result = client.completions.create(prompt="The quick brown fox", logprobs=2, **GREEDY)

    choice = result.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(8)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == logprob and len(top) <= 3  # the 2 likeliest, and the sampled token (one of them here)
        assert max(top.values()) == logprob  # greedy


def test_a_completion_streamed_carries_the_same_logprobs_with_running_offsets(client):
    whole = client.completions.create(prompt="The quick brown fox", logprobs=0, **GREEDY).choices[0].logprobs

    chunks = list(client.completions.create(prompt="The quick brown fox", logprobs=0, stream=True, **GREEDY))

    pieces = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices and chunk.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [value for piece in pieces for value in getattr(piece, field)] == getattr(whole, field)
    assert all(len(top) == 1 for top in whole.top_logprobs)  # logprobs=0: the sampled token's own


def test_sampled_tokens_logprobs_are_the_models_not_the_tempered_distributions(client):
    args = {**GREEDY, "max_tokens": 1}
    greedy = client.completions.create(prompt="Paged attention", logprobs=5, **args).choices[0].logprobs
    hot = client.completions.create(prompt="Paged attention", logprobs=5, **{**args, "temperature": 2, "seed": 1})
    (hot_top,), (greedy_top,) = hot.choices[0].logprobs.top_logprobs, greedy.top_logprobs
    assert {token: hot_top[token] for token in greedy_top} == greedy_top  # and the sampled one's, if not among them
    assert hot_top[hot.choices[0].logprobs.tokens[0]] == hot.choices[0].logprobs.token_logprobs[0]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
], ids=["top-without-logprobs", "chat-past-the-bound", "completion-past-the-bound"])
def test_logprobs_asked_wrongly_get_a_400_naming_the_field(client, path, body, param):
    create = client.chat.completions.create if path == "chat" else client.completions.create
    with pytest.raises(openai.BadRequestError) as info:
        create(model="tiny", max_tokens=2, **body)
    assert info.value.body["param"] == param


def test_a_sim_worker_refuses_logprobs_with_a_400_before_any_work(tiny_llama_dir):
    with running_worker(tiny_llama_dir, "--executor", "sim", "--served-model-name", "tiny", "--max-model-len", "512",
                        "--block-size", "8") as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused") as sim:
            with pytest.raises(openai.BadRequestError) as info:
                sim.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True, stream=True, max_tokens=2)
            assert info.value.body["param"] == "logprobs" and "sim executor" in info.value.body["message"]
            assert sim.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def token_ids(result) -> list[int]:
    return result.choices[0].model_extra["token_ids"]


def test_a_logit_bias_of_100_makes_its_token_the_answer(client):
    result = client.completions.create(prompt="The quick brown fox", logit_bias={"42": 100}, **WITH_IDS)
    assert token_ids(result) == [42] * 8


def test_min_tokens_hold_off_an_eos_the_model_wants_at_once(client, eos_id):
    args = dict(prompt="The quick brown fox", logit_bias={str(eos_id): 100}, model="tiny", temperature=0,
                max_tokens=8)
    assert client.completions.create(**args).usage.completion_tokens == 1
    held = client.completions.create(**args, extra_body={"min_tokens": 3, "return_token_ids": True})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    assert eos_id not in token_ids(held)[:3] and token_ids(held)[3] == eos_id


def test_a_frequency_penalty_makes_a_repeated_token_give_way(client):
    args = dict(prompt="The quick brown fox", logit_bias={"42": 10}, **{**WITH_IDS, "max_tokens": 16})
    plain = token_ids(client.completions.create(**args))
    penalized = token_ids(client.completions.create(**args, frequency_penalty=2, presence_penalty=2))
    assert plain == [42] * 16
    assert 1 <= penalized.count(42) < 16 and penalized[0] == 42  # it gives way once it has been said enough


def test_allowed_token_ids_are_all_the_answer_is_made_of(client):
    args = dict(prompt="The quick brown fox", **{**WITH_IDS, "extra_body": {**WITH_IDS["extra_body"],
                                                                            "allowed_token_ids": [42, 43]}})
    assert set(token_ids(client.completions.create(**args))) <= {42, 43}


def test_special_tokens_stay_in_the_text_when_the_client_asks(client, eos_id):
    args = dict(prompt="The quick brown fox", model="tiny", temperature=0, max_tokens=3,
                logit_bias={str(eos_id): 100})  # EOS thrice (it ends nothing with ignore_eos)
    assert client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text == ""
    kept = client.completions.create(**args, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == "</s></s></s>"


def test_a_min_p_of_one_leaves_only_the_likeliest_token_at_any_temperature(client):
    greedy = client.completions.create(prompt="The quick brown fox", **WITH_IDS)
    hot = client.completions.create(prompt="The quick brown fox", **{**WITH_IDS, "temperature": 2, "seed": 4,
                                                                     "extra_body": {**WITH_IDS["extra_body"],
                                                                                    "min_p": 1.0}})
    assert token_ids(hot) == token_ids(greedy)


@pytest.mark.parametrize(("body", "param"), [
    ({"extra_body": {"allowed_token_ids": [100000]}}, "allowed_token_ids"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 600}}, "min_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
], ids=["allowed-ids-past-the-vocabulary", "logit-bias-past-the-vocabulary", "min-tokens-past-the-room-left",
        "penalty-past-2"])
def test_sampling_options_asked_wrongly_get_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, **body)
    assert info.value.body["param"] == param


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_answer(client):
    text = client.completions.create(prompt="The quick brown fox", **GREEDY).choices[0].text
    stop = text[2:4]
    by_string = client.completions.create(prompt="The quick brown fox", stop=[stop], **GREEDY).choices[0]
    assert (by_string.finish_reason, by_string.model_extra["stop_reason"]) == ("stop", stop)
    ids = token_ids(client.completions.create(prompt="The quick brown fox", **WITH_IDS))
    chunks = list(client.completions.create(prompt="The quick brown fox", stream=True, **{
        **GREEDY, "extra_body": {"ignore_eos": True, "stop_token_ids": [ids[3]]}}))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == ids[3]
    plain = client.completions.create(prompt="The quick brown fox", **GREEDY).choices[0]
    assert (plain.finish_reason, plain.model_extra["stop_reason"]) == ("length", None)


def test_n_choices_are_drawn_each_on_its_own_and_a_seed_repeats_them(client):
    args = dict(model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=1.0, seed=5, n=3,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    result = client.completions.create(**args)

    assert [choice.index for choice in result.choices] == [0, 1, 2]
    drawn = [tuple(choice.model_extra["token_ids"]) for choice in result.choices]
    assert len(set(drawn)) == 3 and all(len(ids) == 6 for ids in drawn)
    assert result.usage.completion_tokens == 18 and result.usage.total_tokens == result.usage.prompt_tokens + 18
    again = client.completions.create(**args)
    assert [tuple(choice.model_extra["token_ids"]) for choice in again.choices] == drawn
    single = client.completions.create(**{**args, "n": 1})
    assert tuple(single.choices[0].model_extra["token_ids"]) == drawn[0]  # choice 0 draws as a request alone


def test_n_streamed_choices_come_interleaved_each_whole_with_one_usage_at_the_end(client):
    args = dict(model="tiny", messages=MESSAGES, max_tokens=5, temperature=1.0, seed=9, n=2, logprobs=True,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))

    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index[choice.index].append(choice)
    for index, choices in by_index.items():
        assert choices[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in choices) == whole.choices[index].message.content
        assert [e.token for c in choices if c.logprobs for e in c.logprobs.content] == \
            [e.token for e in whole.choices[index].logprobs.content]
        assert choices[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10 == whole.usage.completion_tokens


def test_greedy_choices_are_the_same_answer(client):
    result = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, n=2,
                                            extra_body={"ignore_eos": True})
    assert result.choices[0].message.content == result.choices[1].message.content
    assert result.usage.completion_tokens == 8
