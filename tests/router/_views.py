"""Hand-built worker tables for policy tests."""

from __future__ import annotations

from router.load_view import WorkerLoad
from router.types import RouteRequest, WorkerView


def view(
    worker_id: str,
    *,
    requests: int = 0,
    confirmed: int = 0,
    predicted: int = 0,
    queued: int = 0,
    kv: float | None = None,
    waiting: int | None = None,
    decodes: int = 0,
    prefill_tokens_per_s: float = 10_000.0,
    block_size: int = 16,
    free_blocks: int | None = None,
) -> WorkerView:
    load = WorkerLoad(
        in_flight_requests=requests,
        prefill_tokens_queued=queued,
        decode_seqs_running=decodes,
        scraped_waiting_requests=waiting,
        kv_usage_frac=kv,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )
    return WorkerView(worker_id, load, block_size, confirmed, predicted, free_blocks)


def request(num_prompt_tokens: int = 1024, **kw: object) -> RouteRequest:
    return RouteRequest(model="m", prompt="x", num_prompt_tokens=num_prompt_tokens, **kw)  # type: ignore[arg-type]
