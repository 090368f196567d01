"""A load generator's jobs in child processes of their own: each job runs on the load generator's CPUs
(harness/gateway.py cpu_placement) in a fresh uvloop event loop, so the load never shares a loop or a CPU
with what it measures. A benchmark names its jobs (`JOBS = {name: async function}`) and hands its hidden
`--job SPEC` option to `job_main`; the parent starts one with `spawn` and reads its JSON with `collect`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Awaitable, Callable, Mapping

from loadtest.harness.gateway import _pinned, cpu_placement, raise_fd_limit
from loadtest.paths import ROOT

Job = Callable[..., Awaitable[Any]]
TIMEOUT_S = 600.0


def spawn(module: str, job: str, **kwargs: Any) -> subprocess.Popen:
    """`python -m MODULE --job SPEC`, started on the load generator's CPUs."""
    argv = [sys.executable, "-m", module, "--job", json.dumps({"job": job, **kwargs})]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=_pinned(cpu_placement()[1]))


def collect(proc: subprocess.Popen, job: str) -> Any:
    """What a spawned job printed, once it ends; RuntimeError with its stderr's tail if it failed."""
    out, err = proc.communicate(timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator job {job} failed:\n{err[-3000:]}")
    return json.loads(out)


def run(module: str, job: str, **kwargs: Any) -> Any:
    """spawn, then collect."""
    return collect(spawn(module, job, **kwargs), job)


def job_main(jobs: Mapping[str, Job], spec: str) -> None:
    """The child's side: run the job SPEC names with SPEC's arguments, print its result as JSON."""
    import uvloop

    raise_fd_limit()
    kwargs = json.loads(spec)
    job = jobs[kwargs.pop("job")]
    print(json.dumps(uvloop.run(job(**kwargs))))
