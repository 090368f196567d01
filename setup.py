"""Only the optional C extensions; the project's metadata lives in pyproject.toml.

router._blockhash computes chained block keys in one call, router._mask_lookup a prompt's
prefix holders in the KV index (router/block_keys.py and router/mask_table.py fall back to pure
Python without them); worker._paged_attention is the CPU paged decode and prefill attention
(worker/executor/cpu_attention.py; the SDPA backend serves without it); worker._cpu_ops fuses the decoder's
small CPU fp32 ops, RMSNorm, rotary embedding and SiLU(gate) * up (worker/model/cpu_ops.py; the model's torch
code runs without it). optional=True: an install without a C compiler warns and still succeeds.
"""

import sys

from setuptools import Extension, setup

FLAGS = [] if sys.platform == "win32" else ["-O3"]
# `#pragma omp simd` vectorizes the attention's dot products (no OpenMP runtime, no -ffast-math).
SIMD_FLAGS = [] if sys.platform == "win32" else ["-fopenmp-simd"]
# No fused multiply-adds: the fused ops round every product and sum as torch's separate ops do.
NO_CONTRACT_FLAGS = [] if sys.platform == "win32" else ["-ffp-contract=off"]

setup(
    ext_modules=[
        Extension(name, sources=[f"{name.replace('.', '/')}.c"], extra_compile_args=FLAGS, optional=True)
        for name in ("router._blockhash", "router._mask_lookup")
    ] + [
        Extension("worker._paged_attention", sources=["worker/_paged_attention.c"], depends=["worker/_vec.h"],
                  extra_compile_args=FLAGS + SIMD_FLAGS, optional=True),
        Extension("worker._cpu_ops", sources=["worker/_cpu_ops.c"], depends=["worker/_vec.h"],
                  extra_compile_args=FLAGS + NO_CONTRACT_FLAGS, optional=True),
    ]
)
