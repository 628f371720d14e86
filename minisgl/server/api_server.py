"""The API server's app: the routers, the middleware and the state the routes read.

Contract: `create_app(args, model_name, frontend, ...)` wires, and serves nothing itself:
- the routers, each endpoint in its own module: chat.py (POST /v1/chat/completions),
  completions.py (POST /v1/completions), responses/ (POST /v1/responses), ops.py (models,
  /health, /metrics, /debug/*);
- the middleware in front of them (middleware.py): X-Request-Id, the API key check and the
  request body limit;
- `app.state`, which the routes read: the frontend, the args, the model's name and card,
  the output parsers the flags chose (minisgl/parsers/), what the engine fell back from;
- the frontend's observers: the metrics (served by /metrics), the request timelines (by
  /debug/requests) and the stall sweeper, which runs with the listener for the app's life.
No route runs model code or blocks the event loop. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` with a real HTTP status (a validation
error too: 400, not FastAPI's 422, and /openapi.json says so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.parsers import OutputParsers
from minisgl.timeline.api import ApiTimeline, Timelines

from . import chat, completions, ops, responses
from .args import ServerArgs
from .conversation import MESSAGE_ROLES
from .errors import HttpError, from_status, unavailable
from .frontend import FrontendManager
from .metrics import ServerMetrics
from .middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    arrival_var,
    tenant_var,
)
from .protocol import ParamError
from .stalls import StallSweeper

logger = logging.getLogger(__name__)


# --8<-- [start:create_app]
def create_app(
    args: ServerArgs,
    model_name: str,
    frontend: FrontendManager,
    max_model_len: int | None = None,
    degraded: dict[str, str] | None = None,
) -> FastAPI:
    """The app over `frontend` (built beforehand, by the launcher or a test). `max_model_len`
    (the context the scheduler serves) goes on the model card; `degraded` names each part of
    the CUDA fast path the engine's start-up self-check fell back from, with the reason."""
    app = FastAPI(title="minisgl", lifespan=_lifespan)
    state = app.state
    state.frontend, state.args, state.model_name = frontend, args, model_name
    state.model_card = _model_card(model_name, max_model_len)
    state.parsers = OutputParsers.chosen(args.tool_call_parser, args.reasoning_parser)
    state.degraded = degraded or {}
    state.metrics = ServerMetrics()
    state.metrics.set_fallbacks(state.degraded)
    state.timelines = Timelines(args.debug_history)
    state.stalls = StallSweeper(args.client_stall_timeout)
    timelines = ApiTimeline(state.timelines, arrival_var.get, tenant_var.get)
    for observer in (state.metrics, timelines, state.stalls):
        frontend.observe(observer)

    def refused(code: str) -> None:
        frontend.observer.event(None, "refused", code=code)

    # added last = outermost: every answer, a 401 or 413 too, carries its X-Request-Id
    bodies = {"max_bytes": args.max_body_bytes, "max_total": args.max_body_bytes_total}
    app.add_middleware(BodyLimitMiddleware, **bodies, on_reject=refused)
    if args.api_key or args.admin_key:
        keys = {"api_key": args.api_key, "admin_key": args.admin_key}
        app.add_middleware(ApiKeyMiddleware, **keys, on_reject=refused)
    app.add_middleware(RequestIdMiddleware)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for module in (chat, responses, completions, ops):
        app.include_router(module.router)
    _describe_errors_as_openai(app)
    return app


# --8<-- [end:create_app]


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """The frontend's listener and the stall sweeper run while the app does."""
    frontend = app.state.frontend
    tasks = [asyncio.create_task(frontend.listen()), asyncio.create_task(app.state.stalls.run())]
    for task in tasks:
        task.add_done_callback(lambda t: _on_background_exit(t, frontend))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()


def _model_card(model_name: str, max_model_len: int | None) -> dict:
    # `created`: when this server started serving the model
    card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "minisgl"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len  # as vLLM's model card has it
    return card


async def _on_validation_error(request: Request, exc: RequestValidationError):
    error = _validation_error(exc)
    request.app.state.frontend.observer.event(None, "refused", code=error.code or "invalid_request")
    return error.response()


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    error = from_status(exc.status_code, str(exc.detail))
    request.app.state.frontend.observer.event(None, "refused", code=error.code or str(error.status))
    return error.response(exc.headers)


def _validation_error(exc: RequestValidationError) -> HttpError:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    raw = [p for p in first.get("loc", ()) if p != "body"]
    # a message's model is chosen by its role, which pydantic adds to the location
    # ("messages.0.user.content"): the client named no such field
    loc = [
        str(p)
        for i, p in enumerate(raw)
        if not (p in MESSAGE_ROLES and i and isinstance(raw[i - 1], int))
    ]
    if first.get("type") == "union_tag_invalid":  # an unknown role
        loc.append("role")
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return HttpError(400, f"the request body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "unsupported_content_part":  # names the part: messages[0].content[1]
        where = f"{loc[0]}[{loc[1]}].content[{first['ctx']['j']}]" if len(loc) > 1 else "content"
        message = str(first.get("msg")).split(": ", 1)[1]
        return HttpError(400, f"{where}: {message}", code="invalid_value", param=where)
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):  # a cross-field check: it names its parameter
        return HttpError(400, str(cause), code="invalid_value", param=cause.param)
    if first.get("type") == "extra_forbidden":
        message = f"unsupported parameter: {param}"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return HttpError(400, message, code="invalid_value", param=param)


def _on_background_exit(task: asyncio.Task, frontend: FrontendManager) -> None:
    """The listener and the sweeper run for the server's life; if one dies of a bug, no
    request could ever finish: fail them all and report unhealthy rather than hang."""
    if task.cancelled() or task.exception() is None:
        return
    logger.error("a frontend background task died", exc_info=task.exception())
    frontend.fail_all(unavailable(f"internal error in the API server: {task.exception()!r}"))


def _quiet_incomplete_response(record: logging.LogRecord) -> bool:
    """A stalled client's connection is closed on purpose (and logged by us); drop
    uvicorn's generic error line for it."""
    return "ASGI callable returned without completing response" not in record.getMessage()


logging.getLogger("uvicorn.error").addFilter(_quiet_incomplete_response)


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _describe_errors_as_openai(app: FastAPI) -> None:
    """FastAPI documents validation errors as 422 with its own body; this server answers
    400 with the OpenAI error body, so say that in /openapi.json."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for operations in schema.get("paths", {}).values():
                for op in operations.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = {
                            "description": "Invalid request",
                            "content": {"application/json": {"schema": _ERROR_SCHEMA}},
                        }
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
