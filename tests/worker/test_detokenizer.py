"""Incremental detokenization over a real byte-level BPE tokenizer: UTF-8 safety, stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.engine.detokenizer import IncrementalDetokenizer

CORPUS = ["héllo wörld café", "the cat sat on the mat 😀", "stop here. STOP now", "naïve résumé"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """Byte-level BPE: 'é' is one token, 'ü' and emoji are split into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Deltas per token until the detokenizer stops, then the flush."""
    deltas = []
    for token_id in token_ids:
        deltas.append(detok.add_token(token_id))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas


TEXT = st.text(alphabet=list("ab xy.é") + ["ü", "😀", "🎉", "ф"], max_size=30)


@settings(max_examples=150, deadline=None)
@given(prompt=TEXT.filter(bool), output=TEXT)
def test_incremental_text_equals_full_decode_without_broken_characters(
    tokenizer: Tokenizer, prompt: str, output: str
) -> None:
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, prompt))

    deltas = feed(detok, ids(tokenizer, output))

    assert "".join(deltas) == output
    assert all("\ufffd" not in delta for delta in deltas)
    assert detok.text == output


@settings(max_examples=150, deadline=None)
@given(output=TEXT, stop=st.text(alphabet=list("ab xé") + ["😀", "ü"], min_size=1, max_size=4),
       include=st.booleans())
def test_output_is_cut_at_the_first_stop_string(
    tokenizer: Tokenizer, output: str, stop: str, include: bool
) -> None:
    detok = IncrementalDetokenizer(
        tokenizer, ids(tokenizer, "hi"), stop=[stop, "never-matches"],
        include_stop_str_in_output=include,
    )

    text = "".join(feed(detok, ids(tokenizer, output)))

    index = output.find(stop)
    if index == -1:
        assert text == output and not detok.stopped
    else:
        assert text == output[: index + len(stop) if include else index]
        assert detok.matched_stop == stop


def test_split_emoji_waits_for_its_last_byte(tokenizer: Tokenizer) -> None:
    emoji_ids = ids(tokenizer, "😀")
    assert len(emoji_ids) == 2  # the test needs a character split across tokens
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "the cat"))

    assert [detok.add_token(t) for t in emoji_ids] == ["", "😀"]


def test_text_that_may_start_a_stop_string_is_held_until_it_cannot(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "the"), stop=["xy"])

    deltas = [detok.add_token(ids(tokenizer, piece)[0]) for piece in ("a", "x", "b")]

    assert deltas == ["a", "", "xb"]


@pytest.mark.parametrize(
    ("include", "expected"),
    [(False, "cat sat "), (True, "cat sat STOP")],
    ids=["stop-string-dropped", "stop-string-kept"],
)
def test_stop_string_spanning_tokens_truncates_output(
    tokenizer: Tokenizer, include: bool, expected: str
) -> None:
    detok = IncrementalDetokenizer(
        tokenizer, ids(tokenizer, "the"), stop=["STOP"], include_stop_str_in_output=include
    )
    pieces = ("cat", " sat", " ", "ST", "O", "P", " now")
    tokens = [t for piece in pieces for t in ids(tokenizer, piece)]

    text = "".join(feed(detok, tokens))

    assert text == expected and detok.matched_stop == "STOP"


def test_held_back_text_is_flushed_when_the_request_ends(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "the"), stop=["xyz"])

    assert "".join(detok.add_token(t) for t in ids(tokenizer, "abxy")) == "ab"
    assert detok.flush() == "xy"


def test_special_tokens_are_skipped(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "the"))
    eos = tokenizer.token_to_id("<eos>")

    assert "".join(feed(detok, [eos, *ids(tokenizer, "cat")])) == "cat"


def test_long_outputs_decode_with_a_bounded_window(tokenizer: Tokenizer) -> None:
    output = "the cat sat on the mat 😀 " * 40
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "héllo"))

    assert "".join(feed(detok, ids(tokenizer, output))) == output


def test_stop_check_searches_a_window_that_does_not_grow_with_the_output(tokenizer: Tokenizer) -> None:
    piece = "the cat sat on the mat "
    near_miss = (piece * 12)[:255] + "!"  # the output keeps almost matching it: the longest hold-back

    def widest_window(num_pieces: int) -> int:
        detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "hi"), stop=[near_miss, "😀"])
        assert "".join(feed(detok, ids(tokenizer, piece * num_pieces))) == piece * num_pieces
        return detok.max_search_window_chars

    longest_token_chars = max(len(tokenizer.decode([t])) for t in ids(tokenizer, piece))
    short, long = widest_window(20), widest_window(800)  # 460 and 18,400 characters of output
    assert short == long <= len(near_miss) - 1 + longest_token_chars


def test_a_long_stop_string_spread_over_many_tokens_cuts_the_output(tokenizer: Tokenizer) -> None:
    stop = ("stop here. STOP now " * 13)[:256]
    detok = IncrementalDetokenizer(tokenizer, ids(tokenizer, "hi"), stop=[stop])

    text = "".join(feed(detok, ids(tokenizer, "the cat sat " + stop + " naïve")))

    assert text == "the cat sat " and detok.matched_stop == stop
