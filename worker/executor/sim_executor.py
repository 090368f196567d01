"""The `sim` executor: no model math; each step sleeps as long as a calibrated timing model says.

Calibration and how to override it: docs/sim-calibration.md. Torch-free so sim workers start fast.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from worker.executor.base import validate_batch, SeqChunk, StepBatch

_COEFFICIENTS = ("step_overhead_s", "prefill_token_s", "decode_seq_s", "kv_token_s")
_MASK_64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SimTiming:
    """step_s = step_overhead_s + prefill_token_s * prefill tokens + decode_seq_s * decode seqs
    + kv_token_s * context tokens attended (sum over chunks of start_pos + len(token_ids)).

    name says what the coefficients were calibrated for; results measured on sim quote it.
    """

    name: str
    step_overhead_s: float
    prefill_token_s: float
    decode_seq_s: float
    kv_token_s: float

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("sim_timing.name must not be empty")
        for key in _COEFFICIENTS:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"sim_timing.{key} must be a finite number of seconds >= 0, got {value!r}")

    def step_time_s(self, batch: StepBatch) -> float:
        decode_seqs = sum(1 for c in batch.chunks if len(c.token_ids) == 1)
        prefill_tokens = sum(len(c.token_ids) for c in batch.chunks if len(c.token_ids) > 1)
        context_tokens = sum(c.start_pos + len(c.token_ids) for c in batch.chunks)
        return (self.step_overhead_s + self.prefill_token_s * prefill_tokens
                + self.decode_seq_s * decode_seqs + self.kv_token_s * context_tokens)

    def scaled(self, factor: float) -> SimTiming:
        """Every coefficient times factor (factor < 1: a faster sim, e.g. for tests)."""
        if not math.isfinite(factor) or factor < 0:
            raise ValueError(f"sim_timing scale factor must be a finite number >= 0, got {factor!r}")
        scaled = {key: getattr(self, key) * factor for key in _COEFFICIENTS}
        return replace(self, name=f"{self.name} x{factor:g}", **scaled)

    @classmethod
    def parse(cls, text: str, base: SimTiming | None = None) -> SimTiming:
        """`key=value,...` over base (default: DEFAULT_SIM_TIMING); keys are the field names.

        Without a name= key, the result is named after base plus the overrides.
        """
        base = base or DEFAULT_SIM_TIMING
        overrides = _parse_pairs(text)
        values: dict[str, float | str] = {}
        for key, raw in overrides.items():
            values[key] = raw if key == "name" else _parse_seconds(key, raw)
        if "name" not in values:
            values["name"] = f"{base.name} with {text.strip()}"
        return replace(base, **values)


def _parse_pairs(text: str) -> dict[str, str]:
    known = [f.name for f in fields(SimTiming)]
    pairs: dict[str, str] = {}
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError("sim_timing: expected key=value pairs such as prefill_token_s=6e-05, got nothing")
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ValueError(f"sim_timing: {item!r} is not key=value")
        if key not in known:
            raise ValueError(f"sim_timing: unknown key {key!r} (known: {', '.join(known)})")
        if key in pairs:
            raise ValueError(f"sim_timing: key {key!r} given twice")
        pairs[key] = value
    return pairs


def _parse_seconds(key: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"sim_timing.{key} must be a number of seconds, got {raw!r}") from None


# Llama-3.1-8B-Instruct, bf16, one H100 SXM 80GB, vLLM: estimates from public figures, derived in
# docs/sim-calibration.md. Not a measurement.
DEFAULT_SIM_TIMING = SimTiming(
    name="Llama-3.1-8B-Instruct bf16 on 1x H100 SXM 80GB under vLLM (estimated from public figures)",
    step_overhead_s=6.5e-3,
    prefill_token_s=6.0e-5,
    decode_seq_s=2.0e-5,
    kv_token_s=5.0e-8,
)


def _mix64(*values: int) -> int:
    """splitmix64 over the values: a fixed, process-independent hash (unlike hash() of str)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK_64)) * 0xBF58476D1CE4E5B9 & _MASK_64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK_64
        state ^= state >> 31
    return state


class SimExecutor:
    """Executor protocol without a model: sleeps timing.step_time_s(batch), returns stand-in tokens.

    A token is a pure function of the chunk's last token id and, when sampling (temperature > 0),
    of (seed or 0, sample_index); greedy output is a chain next = f(last token), so a prompt
    gives the same output on every worker and a continuation from prompt + output so far goes on
    the same way. Tokens come from ordinary_token_ids (default: the whole vocab), never
    eos_token_id and never the token just fed in, so max_tokens decides the length.
    """

    name = "sim"
    computes_logprobs = False  # its tokens come from a hash, not a distribution

    def __init__(
        self,
        timing: SimTiming,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_id: int | None = None,
        *,
        ordinary_token_ids: range | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timing = timing
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = min(max_model_len, num_blocks * block_size)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.ordinary_token_ids = ordinary_token_ids if ordinary_token_ids is not None else range(vocab_size)
        self._sleep = sleep
        self._clock = clock
        self.busy_s = 0.0  # total time spent in steps (requested sleep + bookkeeping)
        self._validate_config()

    def _validate_config(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1 or self.max_model_len < 1 or self.vocab_size < 1:
            raise ValueError("sim executor: block_size, num_blocks, max_model_len and vocab_size must be >= 1")
        ids = self.ordinary_token_ids
        if len(ids) < 3 or ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"sim executor: ordinary_token_ids must be >= 3 ids within [0, {self.vocab_size})")

    def execute(self, batch: StepBatch) -> list[int]:
        if not batch.chunks:
            return []
        started = self._clock()
        self._validate(batch)
        tokens = [self._token_for(c) for c in batch.chunks if c.sampling is not None]
        remaining_s = self.timing.step_time_s(batch) - (self._clock() - started)
        if remaining_s > 0:
            self._sleep(remaining_s)
        self.busy_s += self._clock() - started
        return tokens

    def _token_for(self, chunk: SeqChunk) -> int:
        last = chunk.token_ids[-1]
        sampling = chunk.sampling
        if sampling is None or sampling.is_greedy:
            mixed = _mix64(last)
        else:
            mixed = _mix64(last, sampling.seed or 0, chunk.sample_index)
        ids = self.ordinary_token_ids
        index = mixed % len(ids)
        while ids[index] in (self.eos_token_id, last):  # at most two steps: two excluded ids
            index = (index + 1) % len(ids)
        return ids[index]

    def _validate(self, batch: StepBatch) -> None:
        validate_batch(batch, self.block_size, self.num_blocks, self.max_model_len)
