"""Continuous batching: which sequences run each step, with how many tokens, and who is preempted.

Each step: running decodes first (most urgent first), then running prefill chunks, then waiting
requests in (priority, arrival) order, all under max_num_batched_tokens and max_num_seqs. Prefill
is chunked to fit the remaining token budget. When a running sequence needs a block and none is
free, the least urgent running sequence (largest priority value, latest arrival) is preempted by
recompute: its blocks are freed (its computed full blocks stay in the prefix cache) and it goes
back to the waiting queue at its original (priority, arrival) place, ahead of later arrivals.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.sequence import Sequence, SequenceStatus
from worker.executor.base import SeqChunk, StepBatch


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence's share of the step: num_new_tokens from num_computed_tokens on."""

    seq: Sequence
    num_new_tokens: int
    samples: bool  # the chunk reaches the end of the sequence, so a token is sampled


def _scheduled(seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
    samples = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
    return ScheduledSeq(seq, num_new_tokens, samples)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the batch for the executor, and what it means for each sequence."""

    batch: StepBatch
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues; the block manager owns the blocks."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self._waiting: list[tuple[tuple[int, float, int], Sequence]] = []
        self._num_waiting = 0
        self._running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return self._num_waiting > 0 or bool(self._running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (seq.queue_key, seq))
        self._num_waiting += 1

    def finish(self, seq: Sequence) -> None:
        """Take seq out of the queues and free its blocks at once (finished or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped when it reaches the top
        seq.status = SequenceStatus.FINISHED

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step; blocks for the planned tokens are allocated before this returns."""
        budget = self.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}
        preempted: list[Sequence] = []
        by_urgency = sorted(self._running, key=_queue_key)
        decodes = [s for s in by_urgency if s.num_uncomputed_tokens == 1]
        prefills = [s for s in by_urgency if s.num_uncomputed_tokens > 1]
        for seq in (*decodes, *prefills):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(seq.num_uncomputed_tokens, budget)
            fits, num_returned_tokens = self._make_room(seq, num_new, scheduled, preempted)
            budget += num_returned_tokens
            if fits:
                scheduled[seq.seq_id] = _scheduled(seq, num_new)
                budget -= num_new
        if not preempted:
            self._admit_waiting(budget, scheduled)
        entries = list(scheduled.values())
        return SchedulerOutput(StepBatch([_chunk(e) for e in entries]), entries, preempted)

    def _make_room(
        self,
        seq: Sequence,
        num_new_tokens: int,
        scheduled: dict[int, ScheduledSeq],
        preempted: list[Sequence],
    ) -> tuple[bool, int]:
        """Append slots for seq, preempting the least urgent running sequences until they fit.

        Returns whether seq fits (False if seq itself was preempted) and the budget tokens handed
        back by victims that had already been scheduled this step.
        """
        num_returned_tokens = 0
        while not self.block_manager.append_slots(seq, num_new_tokens):
            victim = max(self._running, key=_queue_key)
            unscheduled = scheduled.pop(victim.seq_id, None)
            if unscheduled is not None:
                num_returned_tokens += unscheduled.num_new_tokens
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False, num_returned_tokens
        return True, num_returned_tokens

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _admit_waiting(self, budget: int, scheduled: dict[int, ScheduledSeq]) -> None:
        block_manager = self.block_manager
        while budget > 0 and len(self._running) < self.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                return
            cached_block_ids = block_manager.lookup_prefix(seq)
            num_cached_tokens = len(cached_block_ids) * block_manager.block_size
            num_new = min(seq.num_tokens - num_cached_tokens, budget)
            if block_manager.allocate(seq, num_new, cached_block_ids) is None:
                return  # strict order: nothing jumps the head of the queue
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached_tokens
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            scheduled[seq.seq_id] = _scheduled(seq, num_new)
            budget -= num_new

    def _peek_waiting(self) -> Sequence | None:
        """The most urgent waiting sequence, dropping heap entries of finished ones."""
        waiting = self._waiting
        while waiting:
            seq = waiting[0][1]
            if seq.status is SequenceStatus.WAITING:
                return seq
            heapq.heappop(waiting)
        return None

    def complete_step(self, output: SchedulerOutput) -> None:
        """Advance computed tokens of everything that ran and cache newly computed full blocks."""
        cache_full_blocks = self.block_manager.cache_full_blocks
        for entry in output.scheduled:
            entry.seq.num_computed_tokens += entry.num_new_tokens
            cache_full_blocks(entry.seq)


def _queue_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.queue_key


def _chunk(entry: ScheduledSeq) -> SeqChunk:
    seq = entry.seq
    start = seq.num_computed_tokens
    return SeqChunk(
        seq_id=seq.seq_id,
        token_ids=seq.token_ids[start : start + entry.num_new_tokens],
        start_pos=start,
        block_table=list(seq.block_table),
        sampling=seq.sampling_params if entry.samples else None,
        sample_index=seq.num_output_tokens,
    )
