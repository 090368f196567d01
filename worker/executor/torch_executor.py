"""The torch executor: a Llama-family model over a paged KV cache (CPU, or CUDA with Triton + graphs).

Each step flattens every chunk's tokens into one batch: embeddings, projections and MLPs run once
for all sequences (on CPU with weights packed once for oneDNN: cpu_linear.py); attention goes on CPU (fp32) through
the C paged decode and prefill kernels (cpu_attention.py), on CUDA decode-only steps through the Triton paged-decode
kernel, replayed from a CUDA graph captured per padded batch size, and otherwise through the SDPA gather backend.
The lm_head runs only on the last token of chunks that sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from worker.executor.attention import SdpaPagedAttention, StepMetadata, build_step_metadata
from worker.executor.base import validate_batch, StepBatch
from worker.executor.cpu_attention import (CpuMixedAttention, CpuPagedDecodeAttention, CpuPagedPrefillAttention,
                                           cpu_paged_attention_available)
from worker.executor.cpu_linear import pack_linears, packing_available
from worker.executor.kv_cache import KVCacheSpec, PagedKVCache, num_blocks_for_memory_fraction
from worker.executor.sampler import ModelLogprobs, Sampler, adjust_logits
from worker.executor.triton_attention import TritonPagedDecodeAttention, triton_available
from worker.model.config import ModelConfig, load_model_config
from worker.model.llama import LlamaForCausalLM
from worker.model.loader import load_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_KV_BYTES = 1 << 30
_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(frozen=True, slots=True)
class TorchExecutorConfig:
    """How to run the model. KV cache size: num_blocks, else kv_cache_bytes, else
    kv_cache_memory_fraction of free memory (CUDA; default 0.85) or 1 GiB (CPU)."""

    model_dir: str
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU; the checkpoint's bf16/fp16 (else bf16) on CUDA
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_model_len: int | None = None
    use_triton: bool = True  # CUDA decode-only steps
    use_cuda_graphs: bool = True  # CUDA decode-only steps, needs use_triton
    max_graph_batch_size: int = 128
    pack_weights: bool = True  # CPU: linears in oneDNN's packed layout (cpu_linear.py)
    cpu_paged_attention: bool = True  # CPU fp32 steps: the C decode/prefill kernels (cpu_attention.py), else SDPA

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"executor.dtype must be one of {', '.join(_DTYPES)}")
        if self.block_size < 1:
            raise ValueError("executor.block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("executor.num_blocks must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("executor.kv_cache_bytes must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("executor.max_model_len must be >= 1")
        if self.max_graph_batch_size < 1:
            raise ValueError("executor.max_graph_batch_size must be >= 1")


class TorchExecutor:
    """Executor protocol over torch: execute(batch) -> one sampled token per sampling chunk."""

    name = "torch"
    computes_logprobs = True

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        *,
        max_model_len: int | None = None,
        sampler: Sampler | None = None,
        use_triton: bool = True,
        use_cuda_graphs: bool = True,
        max_graph_batch_size: int = 128,
        pack_weights: bool = True,
        cpu_paged_attention: bool = True,
    ) -> None:
        self.model = model
        self.config: ModelConfig = model.config
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.num_blocks = kv_cache.num_blocks
        capacity = kv_cache.num_blocks * kv_cache.block_size
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings, capacity)
        self.vocab_size = self.config.vocab_size  # embedding rows: may differ from the tokenizer's vocabulary
        self.sampler = sampler or Sampler()
        dtype = model.model.embed_tokens.weight.dtype
        self.packed_weights = pack_weights and self.device.type == "cpu" and packing_available(dtype)
        if self.packed_weights:
            pack_linears(model)
        self.cpu_paged_attention = cpu_paged_attention and cpu_paged_attention_available(kv_cache)
        self.use_triton = use_triton and self.device.type == "cuda" and triton_available()
        self._graphs = _DecodeGraphs(self, max_graph_batch_size) if self.use_triton and use_cuda_graphs else None

    @classmethod
    def from_config(cls, config: TorchExecutorConfig) -> TorchExecutor:
        device = torch.device(config.device)
        model_config = load_model_config(config.model_dir)
        dtype = _resolve_dtype(config.dtype, model_config, device)
        model = load_model(config.model_dir, device=device, dtype=dtype, config=model_config)
        spec = KVCacheSpec(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                           config.block_size, dtype)
        kv_cache = PagedKVCache(spec, _num_blocks(config, spec, device), device)
        return cls(model, kv_cache, max_model_len=config.max_model_len, use_triton=config.use_triton,
                   use_cuda_graphs=config.use_cuda_graphs, max_graph_batch_size=config.max_graph_batch_size,
                   pack_weights=config.pack_weights, cpu_paged_attention=config.cpu_paged_attention)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **options) -> TorchExecutor:
        return cls.from_config(TorchExecutorConfig(model_dir=str(model_dir), **options))

    @property
    def num_cuda_graphs(self) -> int:
        """Decode graphs captured so far (0 on CPU or with graphs off)."""
        return 0 if self._graphs is None else len(self._graphs.graphs)

    @torch.inference_mode()  # the logits are adjusted in place (an inference tensor may be only under it)
    def execute(self, batch: StepBatch) -> list[int]:
        if not batch.chunks:
            return []
        logits = self.forward_logits(batch)
        sampling = [c for c in batch.chunks if c.sampling is not None]
        logprobs = ModelLogprobs(logits, sampling)  # the model's own distribution, as vLLM reports it
        tokens = self.sampler.sample(adjust_logits(logits, sampling), [c.sampling for c in sampling],
                                     [c.sample_index for c in sampling])
        logprobs.attach(sampling, tokens)
        return tokens

    @torch.inference_mode()
    def forward_logits(self, batch: StepBatch) -> torch.Tensor:
        """fp32 logits [num sampling chunks, vocab] for the last token of each chunk that samples."""
        self._validate(batch)
        decode_only = all(len(c.token_ids) == 1 for c in batch.chunks)
        if decode_only and self._graphs is not None and self._graphs.fits(len(batch.chunks)):
            return self._graphs.run(batch)
        meta = build_step_metadata(batch, self.block_size, self.device)
        hidden = self.model(meta.input_ids, meta.positions, self._backend(batch, meta))
        return self.model.compute_logits(hidden[meta.sample_rows])

    def _backend(self, batch: StepBatch, meta: StepMetadata):
        if meta.decode_only and self.use_triton:
            return TritonPagedDecodeAttention(self.kv_cache, meta)
        if not self.cpu_paged_attention:
            return SdpaPagedAttention(self.kv_cache, meta)
        if meta.decode_only:
            return CpuPagedDecodeAttention(self.kv_cache, meta)
        if any(len(c.token_ids) == 1 for c in batch.chunks):
            return CpuMixedAttention(self.kv_cache, batch, meta)
        return CpuPagedPrefillAttention(self.kv_cache, batch, meta)

    def _validate(self, batch: StepBatch) -> None:
        validate_batch(batch, self.block_size, self.num_blocks, self.max_model_len)


def _resolve_dtype(name: str | None, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name is not None:
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(config.dtype, torch.bfloat16) if config.dtype != "float32" else torch.bfloat16


def _num_blocks(config: TorchExecutorConfig, spec: KVCacheSpec, device: torch.device) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_bytes is not None:
        return spec.num_blocks_for_bytes(config.kv_cache_bytes)
    if device.type == "cpu" and config.kv_cache_memory_fraction is None:
        return spec.num_blocks_for_bytes(_CPU_DEFAULT_KV_BYTES)
    return num_blocks_for_memory_fraction(spec, device, config.kv_cache_memory_fraction or 0.85)


class _DecodeGraphs:
    """CUDA graphs of a decode-only step (Triton attention + lm_head), one per padded batch size.

    Inputs live in static buffers; padded rows write their K/V to the cache's scratch slot and have
    context length 0 (the kernel returns zeros for them). Graphs are captured on first use.
    """

    def __init__(self, executor: TorchExecutor, max_batch_size: int) -> None:
        self.executor = executor
        self.sizes = [s for s in _GRAPH_BATCH_SIZES if s < max_batch_size] + [max_batch_size]
        size, device = max_batch_size, executor.device
        self.max_blocks = -(-executor.max_model_len // executor.block_size)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, self.max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(self, batch: StepBatch) -> torch.Tensor:
        size = next(s for s in self.sizes if s >= len(batch.chunks))
        self._fill(batch, size)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, logits = self.graphs[size]
        graph.replay()
        rows = [i for i, c in enumerate(batch.chunks) if c.sampling is not None]
        return logits[rows]

    def _fill(self, batch: StepBatch, size: int) -> None:
        block_size = self.executor.block_size
        scratch = self.executor.kv_cache.scratch_slot
        ids, positions, slots, lens = [0] * size, [0] * size, [scratch] * size, [0] * size
        tables = torch.zeros(size, self.max_blocks, dtype=torch.int32)
        for i, chunk in enumerate(batch.chunks):
            pos = chunk.start_pos
            ids[i], positions[i], lens[i] = chunk.token_ids[0], pos, pos + 1
            slots[i] = chunk.block_table[pos // block_size] * block_size + pos % block_size
            table = chunk.block_table[: self.max_blocks]
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.input_ids[:size].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:size].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:size].copy_(tables, non_blocking=True)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        rows = torch.arange(size, device=self.executor.device)
        meta = StepMetadata(self.input_ids[:size], self.positions[:size], self.slot_mapping[:size],
                            self.context_lens[:size], self.block_tables[:size], rows, rows,
                            max_query_len=1, max_context_len=self.max_blocks * self.executor.block_size,
                            decode_only=True)
        backend = TritonPagedDecodeAttention(self.executor.kv_cache, meta)
        model = self.executor.model
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compiles the kernel); same inputs, so same K/V writes
            model.compute_logits(model(meta.input_ids, meta.positions, backend))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = model.compute_logits(model(meta.input_ids, meta.positions, backend))
        self.pool = graph.pool()
        return graph, logits
