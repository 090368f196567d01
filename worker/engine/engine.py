"""The engine loop: add requests, step (schedule -> execute -> postprocess), abort, stats.

Not thread-safe: one thread (the worker service's engine loop) calls every method.

A step whose executor fails (raises, or returns the wrong number of tokens) ends the requests
scheduled in it and raises StepFailed naming them; the engine stays usable. That is safe because
the executor runs before any bookkeeping of the step is committed: computed tokens advance and
blocks enter the prefix cache only after it returns, so ending the step's sequences frees their
blocks without leaving a half-computed block shareable. Any other exception means the scheduler's
or block manager's own state is in doubt, and the caller should stop the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence as SequenceOf
from dataclasses import dataclass

from tokenizers import Tokenizer

from worker.engine.block_hash import model_seed
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.events import KVEventSink
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler, ScheduledSeq
from worker.engine.sequence import FinishReason, Sequence
from worker.executor.base import Executor, LogitsContext, TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (built per step: not frozen, for its cost; never changed
    once built).

    stop_reason is the stop string or stop token id that finished it (None for EOS, length, abort).
    new_token_ids / new_text are this step's delta (new_text is stop-string safe and may be ""
    while text is held back); new_logprobs, one per new token, when the request asked for logprobs
    (else None: an abort's output has none either); num_output_tokens counts the output tokens so far, and
    output_token_ids lists them (a copy, made when read: copying them at every step would cost a
    long answer the square of its length). finish_reason is "stop", "length" or "abort" once
    finished, else None.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    token_ids: list[int]  # the sequence's own prompt + output tokens, which only ever grow: read up to this step's
    new_logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens as of this step."""
        return self.token_ids[self.num_prompt_tokens:self.num_prompt_tokens + self.num_output_tokens]


class StepFailed(RuntimeError):
    """The executor failed a step; the requests of that step were ended (blocks freed, nothing cached)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"the model step failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics (vllm:num_requests_running, vllm:kv_cache_usage_perc, ...).

    Token counters are totals since start: prefix-cache queries/hits count prompt tokens looked
    up / found each time a request is (re)scheduled from waiting; prompt tokens are counted when
    a request produces its first token.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int


class Engine:
    """Serves requests over an executor with paged KV blocks, prefix caching and preemption.

    num_blocks and max_model_len come from config, else from the executor (config may ask for
    less, never more); max_model_len is also capped at num_blocks * block_size so that a single
    sequence always fits in the cache. eos_token_ids end a request with "stop" unless its
    sampling params say ignore_eos.
    """

    def __init__(
        self,
        executor: Executor,
        tokenizer: Tokenizer | None,
        config: EngineConfig,
        event_sink: KVEventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.config = config
        self.num_blocks = _resolve_num_blocks(config, executor)
        self.max_model_len = _resolve_max_model_len(config, executor, self.num_blocks)
        self._executor = executor
        self._tokenizer = tokenizer
        self._clock = clock
        self._eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(
            self.num_blocks,
            config.block_size,
            hash_seed=model_seed(config.model_name),
            enable_prefix_caching=config.enable_prefix_caching,
            event_sink=event_sink,
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self._requests: dict[str, tuple[Sequence, IncrementalDetokenizer | None]] = {}
        self._next_seq_id = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling_params: SamplingParams,
        priority: int = 0,
    ) -> None:
        """Queue a request; raises ValueError if it can never run here."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        prompt = list(prompt_token_ids)
        self._validate_prompt(prompt)
        if sampling_params.stop and self._tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if sampling_params.logprobs is not None and not self.computes_logprobs:
            raise ValueError(f"logprobs are not available from the {self._executor.name} executor: "
                             "it computes no distribution over tokens")
        seq = Sequence(
            seq_id=self._next_seq_id,
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling_params,
            arrival_time_s=self._clock(),
            priority=priority,
        )
        self._next_seq_id += 1
        self._requests[request_id] = (seq, self._make_detokenizer(prompt, sampling_params))
        self.scheduler.add(seq)

    def _validate_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("prompt must have at least one token")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, more than max_model_len {self.max_model_len}"
            )
        if min(prompt) < 0:
            raise ValueError("token ids must be >= 0")

    def _make_detokenizer(
        self, prompt: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        if self._tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self._tokenizer,
            prompt,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason
        "abort"), or None if it is unknown or already finished. step() does not repeat it."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        seq, _ = entry
        self.scheduler.finish(seq)
        seq.finish_reason = FinishReason.ABORT
        return self._output(seq, [], "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def computes_logprobs(self) -> bool:
        """Whether requests may ask for logprobs (executors that do not say they compute them do not)."""
        return getattr(self._executor, "computes_logprobs", False)

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output per request that sampled a token in it."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampling, asking_logprobs = [], []
        for entry, chunk in zip(plan.scheduled, plan.batch.chunks):
            if entry.samples:
                sampling.append((entry, chunk))
                params = chunk.sampling
                if params.adjusts_logits:
                    chunk.logits_context = self._logits_context(entry.seq)
                if params.logprobs is not None:
                    asking_logprobs.append(chunk)
        try:
            sampled = self._executor.execute(plan.batch)
            if len(sampled) != len(sampling):
                raise RuntimeError(
                    f"executor returned {len(sampled)} tokens for {len(sampling)} sampling chunks"
                )
            if any(chunk.logprobs is None for chunk in asking_logprobs):
                raise RuntimeError("executor returned no logprobs for a chunk that asked for them")
        except Exception as exc:
            raise StepFailed(self._end_step(plan.scheduled), exc) from exc
        self.scheduler.complete_step(plan)
        return [self._postprocess(entry, token, chunk.logprobs) for (entry, chunk), token in zip(sampling, sampled)]

    def _logits_context(self, seq: Sequence) -> LogitsContext:
        """The sequence's tokens for its penalties; under min_tokens, the stop tokens it may not draw yet."""
        params = seq.sampling_params
        banned: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            eos = () if params.ignore_eos else tuple(self._eos_token_ids)
            banned = tuple(dict.fromkeys((*eos, *params.stop_token_ids)))
        return LogitsContext(seq.token_ids, seq.num_prompt_tokens, banned)

    def _end_step(self, scheduled: list[ScheduledSeq]) -> list[str]:
        """End the requests of a step the executor failed (before complete_step); their ids."""
        request_ids = []
        for entry in scheduled:
            seq = entry.seq
            self._requests.pop(seq.request_id, None)
            self.scheduler.finish(seq)
            seq.finish_reason = FinishReason.ABORT
            request_ids.append(seq.request_id)
        return request_ids

    def _postprocess(self, entry: ScheduledSeq, token_id: int, logprobs: TokenLogprobs | None) -> RequestOutput:
        seq = entry.seq
        seq.append_token(token_id)
        self._num_generation_tokens += 1
        if seq.num_output_tokens == 1:
            self._num_prompt_tokens += seq.num_prompt_tokens
        _, detokenizer = self._requests[seq.request_id]
        reason, text = self._check_stop(seq, token_id, detokenizer)
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            del self._requests[seq.request_id]
        return self._output(seq, [token_id], text, None if logprobs is None else [logprobs])

    def _check_stop(
        self, seq: Sequence, token_id: int, detokenizer: IncrementalDetokenizer | None
    ) -> tuple[FinishReason | None, str]:
        """Finish reason (vLLM's order: EOS, stop token, stop string, length) and text delta."""
        params = seq.sampling_params
        reason: FinishReason | None = None
        text = ""
        if params.min_tokens and seq.num_output_tokens < params.min_tokens:  # not yet: nothing stops it (as vLLM)
            if detokenizer is not None:
                text = detokenizer.add_token(token_id, stops=False)
        elif not params.ignore_eos and token_id in self._eos_token_ids:
            reason = FinishReason.STOP
        elif token_id in params.stop_token_ids:
            reason = FinishReason.STOP
            seq.stop_reason = token_id
            if detokenizer is not None and params.include_stop_str_in_output:
                text = detokenizer.add_token(token_id)
        elif detokenizer is not None:
            text = detokenizer.add_token(token_id)
            if detokenizer.stopped:
                seq.stop_reason = detokenizer.matched_stop
                return FinishReason.STOP, text
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is not None and detokenizer is not None:
            text += detokenizer.flush()
        return reason, text

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str,
                new_logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            token_ids=seq.token_ids,
            new_logprobs=new_logprobs,
            stop_reason=seq.stop_reason,
        )

    # ---- introspection -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        block_manager = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=block_manager.usage,
            prefix_cache_queries_tokens=block_manager.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=block_manager.prefix_cache_hits_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()


def _resolve_num_blocks(config: EngineConfig, executor: Executor) -> int:
    if config.block_size != executor.block_size:
        raise ValueError(
            f"engine.block_size {config.block_size} differs from the executor's "
            f"{executor.block_size}"
        )
    if config.num_blocks is None:
        return executor.num_blocks
    if config.num_blocks > executor.num_blocks:
        raise ValueError(
            f"engine.num_blocks {config.num_blocks} exceeds the executor's {executor.num_blocks}"
        )
    return config.num_blocks


def _resolve_max_model_len(config: EngineConfig, executor: Executor, num_blocks: int) -> int:
    """The configured or model length, capped so one sequence always fits in the KV cache."""
    if config.max_model_len is not None and config.max_model_len > executor.max_model_len:
        raise ValueError(
            f"engine.max_model_len {config.max_model_len} exceeds the model's "
            f"{executor.max_model_len}"
        )
    max_model_len = config.max_model_len or executor.max_model_len
    return min(max_model_len, num_blocks * config.block_size)
