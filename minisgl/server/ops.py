"""The routes that answer about the server rather than generate.

Contract: GET /v1/models and /v1/models/{id} (the model card, with `max_model_len`), GET
/health (health.py decides), GET /metrics (Prometheus text: the metrics observer's counts
and, asked at scrape time, the workers' gauges), GET /debug/lifecycle (every process's
live per-uid state), GET /debug/requests (request timelines: at most `limit` of each list,
only those ended after the `since`-th end, or one request id's; bounded whatever the
history holds, so a page polling it never stalls the server), GET /debug (the live page),
POST /debug/flush_cache (admin: empties the prefix cache when no request is in flight,
409 otherwise). Each reads what it needs from `request.app.state`. Under API keys a tenant's
timelines are its own and /debug/lifecycle tells no sizes but to the operator (tenants.py).
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import msgspec
from fastapi import APIRouter, Query, Request
from starlette.responses import HTMLResponse, Response

from . import tenants
from .endpoint import unknown_model
from .errors import HttpError, RequestFailed, to_http, unavailable
from .health import decide_health
from .middleware import tenant_var

router = APIRouter()


@router.get("/v1/models")
async def v1_models(request: Request):
    return {"object": "list", "data": [request.app.state.model_card]}


@router.get("/v1/models/{model_id:path}")  # hub ids hold a slash: Qwen/Qwen3-0.6B
async def v1_model(model_id: str, request: Request):
    return unknown_model(request, model_id) or request.app.state.model_card


@router.get("/health")
async def health(request: Request):
    return decide_health(request.app.state.frontend, request.app.state.degraded).response()


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    frontend = request.app.state.frontend
    try:
        sched = (await frontend.lifecycle(timeout=5.0)).scheduler
    except (RequestFailed, asyncio.TimeoutError):
        sched = None  # the workers' gauges keep their last values
    body = request.app.state.metrics.render(len(frontend.states), sched)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/debug/requests")
async def debug_requests(
    request: Request,
    limit: int = Query(100, ge=1, le=1000),
    since: int = Query(0, ge=0),
    request_id: str | None = None,
):
    """Timelines of the requests in flight and of the last --debug-history ended."""
    states = request.app.state.frontend.states
    counts = {
        uid: (s.buffer.prompt_tokens, s.buffer.completion_tokens) for uid, s in states.items()
    }
    timelines = request.app.state.timelines
    owner = tenants.owner_filter(tenant_var.get())
    return timelines.snapshot(counts, limit, since, request_id, owner=owner)


@router.get("/debug", response_class=HTMLResponse)
async def debug_page():
    """The live page: it polls /debug/lifecycle and /debug/requests."""
    return HTMLResponse(_debug_page())


@router.get("/debug/lifecycle")
async def debug_lifecycle(request: Request):
    try:
        lifecycle = await request.app.state.frontend.lifecycle()
        return tenants.coarse(msgspec.to_builtins(lifecycle))  # unset fields left out
    except RequestFailed as failed:
        return to_http(failed.error).response()
    except asyncio.TimeoutError:
        return to_http(unavailable("a worker did not answer the state query")).response()


# --8<-- [start:flush_cache]
@router.post("/debug/flush_cache")
async def debug_flush_cache(request: Request):
    """Empty the prefix cache (admin). 409 while any request is in flight."""
    frontend = request.app.state.frontend
    busy = HttpError(409, "requests are in flight: flush the cache when idle", code="busy")
    if frontend.states:
        return busy.response()
    try:
        state = await frontend.lifecycle(flush_cache=True)
    except RequestFailed as failed:
        return to_http(failed.error).response()
    except asyncio.TimeoutError:
        return to_http(unavailable("the scheduler did not answer")).response()
    flushed = state.scheduler.flushed_pages
    return busy.response() if flushed < 0 else {"flushed_pages": flushed}


# --8<-- [end:flush_cache]


@functools.cache
def _debug_page() -> str:
    return (Path(__file__).parent / "static" / "debug.html").read_text()
