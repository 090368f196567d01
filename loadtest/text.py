"""Deterministic word-salad text: a fixed word list, a seeded RNG, and an approximate token count.

TOKENS_PER_WORD is the measured ratio for this word list under SmolLM2's BPE tokenizer (words
joined by single spaces); other tokenizers differ by a few percent. Exact counts come from `usage`.
"""

from __future__ import annotations

import random

WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy music market sense nation plan college
interest death experience effect use class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population site river
good new first last long great little own other old right big high different small large next
early young important few public bad same able green blue red quick slow bright dark warm cold
""".split()))

TOKENS_PER_WORD = 1.0
"""Tokens per word of this list under SmolLM2's tokenizer (measured 5,000 words -> 5,000 tokens)."""


def words_for_tokens(num_tokens: int) -> int:
    """How many words make about `num_tokens` tokens (at least 1)."""
    return max(1, round(num_tokens / TOKENS_PER_WORD))


def word_salad(rng: random.Random, num_tokens: int) -> str:
    """About `num_tokens` tokens of words drawn from WORDS with `rng`."""
    return " ".join(rng.choice(WORDS) for _ in range(words_for_tokens(num_tokens)))


def seeded_text(seed: object, num_tokens: int) -> str:
    """The same text for the same (seed, num_tokens), in any process (string seeds are hashed stably)."""
    return word_salad(random.Random(str(seed)), num_tokens)
