"""The paged KV cache: per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim].

One extra scratch block sits after the last real block: padded tokens (CUDA-graph batches) write
their K/V there, so they never touch a block the engine handed out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_cache.{name} must be >= 1")

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def num_blocks_for_bytes(self, budget_bytes: int) -> int:
        return max(0, budget_bytes // self.bytes_per_block - 1)  # one block is the scratch block


def available_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory on CUDA; total physical memory on CPU."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_blocks_for_memory_fraction(spec: KVCacheSpec, device: torch.device, memory_fraction: float) -> int:
    if not 0 < memory_fraction <= 1:
        raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
    return spec.num_blocks_for_bytes(int(available_memory_bytes(device) * memory_fraction))


class PagedKVCache:
    """Preallocated K/V blocks; key_cache[layer] and value_cache[layer] are the engine-visible blocks."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError("kv_cache.num_blocks must be >= 1 (the memory budget is too small)")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.device = torch.device(device)
        shape = (num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self._keys = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self._values = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.key_cache = [k[:num_blocks] for k in self._keys]
        self.value_cache = [v[:num_blocks] for v in self._values]

    @property
    def scratch_slot(self) -> int:
        """A slot in the scratch block, for tokens whose K/V must go nowhere."""
        return self.num_blocks * self.block_size

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer including the scratch block."""
        return self._keys[layer_index], self._values[layer_index]

    def write(self, layer_index: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at flat slots [T] (block * block_size + offset)."""
        keys, values = self.layer(layer_index)
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        keys.view(-1, heads, dim).index_copy_(0, slots, k.to(keys.dtype))
        values.view(-1, heads, dim).index_copy_(0, slots, v.to(values.dtype))
