"""A request body as strict JSON: the one parser the gateway and the worker both use, and the
encoder for the bodies the gateway sends on.

Strict means what JSON says and Python's json module does not enforce: NaN, Infinity, numbers
too large for a float and strings with an unpaired UTF-16 surrogate escape (not text: they cannot
be tokenized or sent on as UTF-8) are refused, as is nesting too deep for the parser; every
problem is an ApiError 400. `yielding=True` parses or encodes the same way but lets other threads run meanwhile
(kvgate/offload.py runs a large body's work in a worker thread with it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any, Callable

import orjson

from kvgate.api_error import ApiError


def parse_json_object(raw: bytes, *, yielding: bool = False, max_prompt_tokens: int | None = None) -> dict[str, Any]:
    """raw as a JSON object; ApiError(400) naming what is wrong.

    yielding: convert integers through a Python function. The C scanner otherwise holds the
    interpreter lock for the whole body (~60 ms for 700k token ids), so a thread parsing it would
    stall the event loop as much as parsing on the loop; with a Python call per integer the lock
    is handed over every switch interval. It costs ~2.5x the CPU, so use it only off the loop.

    max_prompt_tokens (with yielding): the longest prompt any model behind this server takes. A
    body holding more integers than that plus MAX_OTHER_INTEGERS cannot be served; it is refused
    (400 context_length_exceeded) as soon as the parser counts past them, so a 4 MiB body of token
    ids costs a fraction of its parse.
    """
    decoder = _DECODER
    if yielding:
        decoder = _strict_decoder(_int if max_prompt_tokens is None else _counting_int(max_prompt_tokens))
    try:  # as json.loads reads bytes (UTF-8, -16 or -32), without building a decoder per body
        value = decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # NaN, Infinity, or a number too large for a float
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise ApiError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):  # only an escape can make one
        raise ApiError(400, "request body is not valid JSON: a string holds an unpaired UTF-16 surrogate "
                            "(\\ud800-\\udfff)")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in value is not encodable as UTF-8; level by level, no recursion."""
    level = [value]
    while level:
        deeper = []
        for item in level:
            if isinstance(item, str):
                strings = (item,)
            elif isinstance(item, dict):
                strings = item.keys()
                deeper += item.values()
            elif isinstance(item, list):
                strings = ()
                deeper += item
            else:
                continue
            for text in strings:
                try:
                    text.encode()
                except UnicodeEncodeError:
                    return True
        level = deeper
    return False


def dump_json(value: Any, *, yielding: bool = False) -> bytes:
    """value as compact UTF-8 JSON (ValueError for NaN or Infinity).

    orjson encodes it, ~10x faster; where orjson declines (an integer beyond 64 bits, a key that
    is not a string) or writes a null (it writes NaN and Infinity as null, so json's encoder then
    tells), json's encoder does. The two write some floats differently (0.00001 for 1e-05): the
    same numbers.

    yielding: encode long lists (a prompt's token ids, a long conversation) a slice at a time, so
    the interpreter lock can pass to other threads between slices; the bytes are the same."""
    try:
        encoded = b"".join(json_pieces(value, orjson.dumps, _SLICE)) if yielding else orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError included
        encoded = None
    if encoded is not None and encoded.find(b"null") < 0:  # find: bytes' `in` raises and clears an error each time
        return encoded
    if not yielding:
        return _ENCODER.encode(value).encode()
    return b"".join(json_pieces(value, _encode_strict, _SLICE))


DESCEND_ITEMS = 8  # a list this short is descended into by json_pieces (a response's `choices`), not encoded whole


def json_pieces(value: Any, encode: Callable[[Any], bytes], slice_items: int) -> Iterator[bytes]:
    """encode(value) a piece at a time (the pieces joined are its bytes, for a compact encode), for a
    large value encoded beside other work: between pieces the interpreter lock can pass to another
    thread, or the event loop run. Dicts with string keys and lists of up to DESCEND_ITEMS items are
    descended into, a longer list than slice_items is encoded slice_items items at a time, anything
    else by encode whole."""
    if type(value) is dict and all(type(key) is str for key in value):
        yield b"{"
        for index, (key, item) in enumerate(value.items()):
            yield (b"," if index else b"") + encode(key) + b":"
            yield from json_pieces(item, encode, slice_items)
        yield b"}"
    elif type(value) is list and len(value) <= DESCEND_ITEMS:
        yield b"["
        for index, item in enumerate(value):
            if index:
                yield b","
            yield from json_pieces(item, encode, slice_items)
        yield b"]"
    elif type(value) is list and len(value) > slice_items:
        for start in range(0, len(value), slice_items):
            yield (b"[" if start == 0 else b",") + encode(value[start:start + slice_items])[1:-1]
        yield b"]"
    else:
        yield encode(value)


def _encode_strict(value: Any) -> bytes:
    return _ENCODER.encode(value).encode()


MAX_OTHER_INTEGERS = 65_536  # a body's integers beside its prompt's token ids (logit_bias, stop_token_ids...)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # one pass over the raw body (~0.5 ns a byte)
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)  # built once
_SLICE = 4096  # list items encoded at a time by dump_json(yielding=True): ~0.5 ms for token ids


def _int(text: str) -> int:
    return int(text)


def _counting_int(max_prompt_tokens: int) -> Callable[[str], int]:
    limit = max_prompt_tokens + MAX_OTHER_INTEGERS
    count = 0

    def parse_int(text: str) -> int:
        nonlocal count
        count += 1
        if count > limit:  # not a ValueError: it leaves json.loads and the handlers above as it is
            raise ApiError(400, f"request body holds more than {limit:,} integers, but the longest prompt any "
                                f"model here takes is {max_prompt_tokens:,} tokens", param="prompt",
                           code="context_length_exceeded")
        return int(text)

    return parse_int


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _strict_decoder(parse_int: Callable[[str], int] | None = None) -> json.JSONDecoder:
    """Strict JSON: NaN and Infinity refused, a float must be finite."""
    return json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, parse_int=parse_int)


_DECODER = _strict_decoder()  # built once: the parse on the event loop
