"""Timers for a profile of the engine's steps (loadtest/benchmarks/engine_profile.py drives it): each part of a
step wrapped in a wall-clock timer (CPU ops are synchronous), undone when the caller's ExitStack closes.
Profiling only: nothing here runs in a serving worker."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

import worker.executor.torch_executor as torch_executor_module
import worker.model.attention as attention_module
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.engine import Engine
from worker.executor.cpu_linear import PackedLinear
from worker.executor.torch_executor import TorchExecutor
from worker.model.norm import RMSNorm


class StepTimers:
    """Seconds per part, summed over the steps measured while `on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False

    def timed(self, part: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
        return wrapper

    def module_hooks(self, module: nn.Module, part: str) -> list:
        started: list[float] = []

        def before(_module, _inputs):
            if self.on:
                started.append(time.perf_counter())

        def after(_module, _inputs, _output):
            if self.on and started:
                self.seconds[part] += time.perf_counter() - started.pop()

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def instrument(stack: ExitStack, engine: Engine, executor: TorchExecutor, timers: StepTimers) -> None:
    """Wrap every part of a step in a timer, undone when stack closes."""
    def patch(owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)
        setattr(owner, name, timers.timed(part, original))
        stack.callback(setattr, owner, name, original)

    patch(engine, "step", "step")
    patch(executor, "execute", "execute")
    patch(executor, "forward_logits", "forward and logits")
    patch(executor.sampler, "sample", "sampling")
    patch(torch_executor_module, "build_step_metadata", "step metadata")
    patch(attention_module, "apply_rotary_qk", "rope")
    patch(IncrementalDetokenizer, "add_token", "detokenization")
    original_backend = executor._backend

    def timed_backend(batch, meta):
        return timers.timed("attention (paged)", original_backend(batch, meta))

    executor._backend = timed_backend
    stack.callback(setattr, executor, "_backend", original_backend)
    model = executor.model
    handles = []
    for module in model.modules():
        if module is model.lm_head:
            handles += timers.module_hooks(module, "lm_head")
        elif isinstance(module, (nn.Linear, PackedLinear)):
            handles += timers.module_hooks(module, "matmuls (q/k/v/o, MLP)")
        elif isinstance(module, RMSNorm):
            handles += timers.module_hooks(module, "norms")
    handles += timers.module_hooks(model, "forward")
    stack.callback(lambda: [h.remove() for h in handles])


def decode_weight_bytes(model: nn.Module) -> int:
    """The bytes of weights a decode step reads: its memory-bound floor at batch 1 is this over the
    memory bandwidth (loadtest/benchmarks/engine_side_by_side.py measures that). Packed linears count their packed
    copy; the embedding matrix counts only where lm_head reads it (tied and not packed): a step reads
    one row of it otherwise."""
    embedding = model.model.embed_tokens.weight
    lm_head = getattr(model.lm_head, "weight", None)
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())
               if t is not embedding or lm_head is embedding}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def torch_threads(count: int | None = None) -> int:
    """torch's intra-op threads (set to count first, when given)."""
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()


def torch_version() -> str:
    return torch.__version__
