"""Linear layers on CPU with their weights packed once, at load, in oneDNN's blocked layout.

A plain nn.Linear hands its row-major weight to the BLAS on every call, which repacks it into the
layout its kernel reads each time; for decode's few rows that repacking costs as much as the matmul.
oneDNN reorders the weight once (torch.ops.mkldnn._reorder_linear_weight) and its matmul reads the
packed copy directly, the way vLLM's CPU backend and inductor's weight prepacking run linears.
Results differ from nn.Linear's only in summation order (~1e-6 relative in fp32).

oneDNN caches a compiled kernel (and its scratch memory) per input shape, 0.2-4 MB each, up to 1,024 of
them: a step's row count takes any value up to the token budget, so those caches alone grew the worker
by hundreds of MB. Inputs are therefore padded to one of ROW_BUCKETS rows (up to 8, the next power of two;
up to TILE_ROWS, the next multiple of 16; beyond, tiles of TILE_ROWS): 20 shapes per weight shape. Padding
a decode's few rows costs next to nothing (the weights' reading dominates); rows are independent, so
padding rows never mix into a real one (the kernel picked for the padded size may only round differently).
"""

from __future__ import annotations

import torch
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The batch the packed layout is chosen for: decode batches of a few to a few dozen rows.
_BATCH_HINT = 32
ROW_STEP = 16
TILE_ROWS = 256
ROW_BUCKETS = (1, 2, 4, 8, *range(ROW_STEP, TILE_ROWS + 1, ROW_STEP))


def padded_rows(rows: int) -> int:
    """The bucket a call of `rows` (<= TILE_ROWS) rows runs at."""
    return next(b for b in ROW_BUCKETS[:4] if b >= rows) if rows <= 8 else -(-rows // ROW_STEP) * ROW_STEP


def packing_available(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and dtype in PACKED_DTYPES and (
        dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x @ W.T + b over [T, in_features] inputs, W held only in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > TILE_ROWS:
            return torch.cat([self.forward(x[start:start + TILE_ROWS]) for start in range(0, rows, TILE_ROWS)])
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out if padded == rows else out[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in model by a PackedLinear (an lm_head tied to the embeddings gets a packed
    copy; the embedding keeps the original). Returns how many were replaced."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, linear in targets:
        setattr(parent, name, PackedLinear(linear))
    return len(targets)
