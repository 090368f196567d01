"""TokenBytes: the bytes each token stands for, for logprobs, on each kind of vocabulary."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from worker.model.tokenizer import _BYTE_OF_CHAR, TokenBytes

TEXTS = ["Hello! 🌍 naïve café — 東京", "plain ascii words", "ŝ ŝ ŝ ŝ ŝ ŝ"]


def byte_level_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS, trainer)
    return tokenizer


def test_the_byte_level_table_covers_the_whole_byte_level_alphabet_once_per_byte():
    assert set(_BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(_BYTE_OF_CHAR.values()) == list(range(256))


def test_byte_level_tokens_join_back_into_the_text_where_they_split_characters():
    tokenizer = byte_level_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    for text in [*TEXTS, "unseen: 😀 Ωμέγα"]:
        ids = tokenizer.encode(text).ids
        assert b"".join(token_bytes(i) for i in ids) == text.encode()
    split = [token_bytes(i) for i in tokenizer.encode("😀").ids]
    assert len(split) > 1 and all(piece != piece.decode("utf-8", "replace").encode() for piece in split)


def test_an_added_token_is_its_own_text():
    tokenizer = byte_level_tokenizer()
    assert TokenBytes(tokenizer)(tokenizer.token_to_id("<|end|>")) == b"<|end|>"


def test_a_byte_fallback_token_is_the_byte_it_names():
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x82>": 2, "<0xAC>": 3, "▁a": 4}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i) for i in (1, 2, 3)) == "€".encode()
    assert token_bytes(4) == " a".encode()  # any other token: its decoded text


def test_a_word_level_token_is_its_decoded_text_and_an_unknown_id_has_none():
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.add_special_tokens([AddedToken("[END]", special=True)])
    token_bytes = TokenBytes(tokenizer)
    assert (token_bytes(0), token_bytes(1), token_bytes(3)) == (b"hello", b"world", b"[END]")
    assert token_bytes(99) == b""
