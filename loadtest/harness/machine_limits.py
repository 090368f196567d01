"""What one core of this machine can do, measured here: memory bandwidth (numpy copies) and the fp32 peak
(the best one-thread sgemm of numpy's BLAS, torch's BLAS and oneDNN, in a child pinned to the core), and
the nominal peak from vector width and clock. Engine benchmarks set their figures against these."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SGEMM_SIZE = 1536  # the fp32 peak's probe: big enough to run at the core's speed, not the memory's


def memory_bandwidth_bytes_s(size_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """One core's read bandwidth: the best of `repeats` integer sums over an array of size_bytes (one
    thread, a plain vectorized loop; numpy's float sum is pairwise and can run below the memory's speed:
    20.7 against 33.3 GB/s on an AMD EPYC core)."""
    array = np.ones(size_bytes // 8, dtype=np.uint64)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        array.sum()
        best = min(best, time.perf_counter() - start)
    return size_bytes / best

_SGEMM_PROBE = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
n, repeats = int(sys.argv[2]), int(sys.argv[3])

def best(matmul):
    matmul()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul()
        times.append(time.perf_counter() - start)
    print(f"{2 * n ** 3 / min(times)}", end="\t")

import numpy as np
a = np.ones((n, n), dtype=np.float32)
best(lambda: a @ a)
print("numpy's BLAS")
import torch
torch.set_num_threads(1)
x = torch.ones(n, n)
best(lambda: x @ x)
print("torch's BLAS")
if torch.backends.mkldnn.is_available():
    packed = torch.ops.mkldnn._reorder_linear_weight(x, n)
    best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    print("oneDNN")
"""


def measured_fp32_peak_flops(cpu: int, size: int = SGEMM_SIZE, repeats: int = 5) -> tuple[float, str]:
    """(one core's fp32 peak as reached, the library that reached it): the best of `repeats` square
    sgemms of `size` in each of numpy's BLAS, torch's BLAS and oneDNN (the engines' linears), one thread,
    in a child pinned to `cpu`. The clock in /proc/cpuinfo is not the clock a busy core runs at, the
    vector width does not say how many FMA units carry it (AMD's AVX-512 before Zen 5 runs on two 256-bit
    units), and one library alone can miss the core's widest kernels (numpy's OpenBLAS reached 109
    GFLOP/s on an AMD EPYC core where oneDNN reached 219), so the limit is the best measured."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SGEMM_PROBE, str(cpu), str(size), str(repeats)], env=env,
                         check=True, capture_output=True, text=True, timeout=180).stdout
    reached = [(float(flops), library) for flops, library in (line.split("\t") for line in out.splitlines())]
    return max(reached)


def nominal_fp32_peak_flops() -> tuple[float, str]:
    """(one core's fp32 peak in flop/s from its vector width and the clock /proc/cpuinfo reports, how it
    was derived): lanes x 2 FMA units x 2 flops x clock. Shown beside the measured peak."""
    text = Path("/proc/cpuinfo").read_text()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    mhz = max((float(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu MHz")),
              default=2000.0)
    lanes, unit = (16, "AVX-512") if "avx512f" in flags else (8, "AVX2") if "avx2" in flags else (4, "SSE")
    return lanes * 2 * 2 * mhz * 1e6, f"{unit} {lanes} lanes x 2 FMA units x 2 flops x {mhz / 1000:.2f} GHz"
