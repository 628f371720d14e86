"""The API server: FastAPI routes over a FrontendManager.

Contract: routes parse and check the request, turn it into a TokenizeMsg and hand it to a
response object (response.py) that owns the request's lifecycle. No route runs model code
or blocks the event loop. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}` with a real HTTP status.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (the Responses
API, translated to the chat path: responses.py, responses_format.py), GET /v1/models, GET
/v1/models/{id} (the model card, with `max_model_len`), GET /health, GET /metrics, GET
/debug/lifecycle, GET /debug/requests (request timelines), GET /debug (the live page),
POST /debug/flush_cache (admin: empties the prefix cache when idle). In front of them:
X-Request-Id, the API key check and the request body limit (middleware.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, Response

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, pack_ids
from minisgl.timeline.api import ApiTimeline, Timelines

from .args import ServerArgs
from .errors import HttpError, RequestFailed, to_http, unavailable
from .formats import ChatFormat, CompletionFormat
from .frontend import FrontendManager
from .health import decide_health
from .metrics import ServerMetrics
from .middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    arrival_var,
    request_id_var,
    tenant_var,
)
from .protocol import MESSAGE_ROLES, ChatCompletionRequest, CompletionRequest, ParamError
from .response import FullResponse, Job, StreamResponse
from .responses import ResponsesRequest
from .responses_format import ResponsesFormat
from .stalls import StallSweeper

logger = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


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


def create_app(
    args: ServerArgs,
    model_name: str,
    frontend: FrontendManager,
    max_model_len: int | None = None,
    degraded: dict[str, str] | None = None,
) -> FastAPI:
    """The routes over `frontend` (built beforehand, by the launcher or a test); its
    listener and stall sweeper run while the app does. `max_model_len` (the context length
    the scheduler serves) goes on the model card; `degraded` names each part of the CUDA
    fast path the engine's start-up self-check fell back from, with the reason."""
    metrics = ServerMetrics()
    timelines = Timelines(args.debug_history)
    sweeper = StallSweeper(args.client_stall_timeout)
    for observer in (metrics, ApiTimeline(timelines, arrival_var.get), sweeper):
        frontend.observe(observer)
    degraded = degraded or {}
    metrics.set_fallbacks(degraded)
    created = int(time.time())  # the model card's: when this server started serving it

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [
            asyncio.create_task(frontend.listen()),
            asyncio.create_task(sweeper.run()),
        ]
        for task in tasks:
            task.add_done_callback(lambda t: _on_background_exit(t, frontend))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()

    app = FastAPI(title="minisgl", lifespan=lifespan)
    app.state.metrics = metrics
    # added last = outermost: every answer, a 401 or 413 too, carries its X-Request-Id
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=args.max_body_bytes, on_reject=metrics.on_rejected
    )
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, on_reject=metrics.on_rejected)
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError):
        error = _validation_error(exc)
        metrics.on_rejected(error.code or "invalid_request")
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code)
        metrics.on_rejected(code or str(exc.status_code))
        return HttpError(exc.status_code, str(exc.detail), code=code).response()

    def unknown_model(model: str | None) -> Response | None:
        if model is None or model == model_name:  # None: omitted, the served one
            return None
        metrics.on_rejected("model_not_found")
        message = f"the model {model!r} does not exist; this server serves {model_name!r}"
        return HttpError(404, message, code="model_not_found", param="model").response()

    def salted(params: SamplingParams) -> SamplingParams:
        """--cache-salt-per-key: the API key the request came with joins its cache salt, so
        tenants with different keys never share cached prefix pages."""
        tenant = tenant_var.get()
        if args.cache_salt_per_key and tenant is not None:
            params.cache_salt = f"{tenant}:{params.cache_salt or ''}"
        return params

    # --8<-- [start:respond]
    def respond(req: ChatCompletionRequest | CompletionRequest, job: Job):
        if req.user is not None:
            logger.info("request %s: user %r", request_id_var.get(), req.user)
        return (StreamResponse if req.stream else FullResponse)(frontend, job)

    # --8<-- [end:respond]

    # --8<-- [start:chat_route]
    def chat_job(req: ChatCompletionRequest, fmt: ChatFormat) -> Job:
        """How a chat request is served, in the wire format `fmt` (chat, or responses)."""
        params = salted(req.sampling_params())
        messages = [m.as_template_input() for m in req.messages]
        tools = req.template_tools()
        # a constrained output (forced calls, JSON) is all answer: it has no think block
        free = params.grammar is None and params.json_schema is None
        reasoning = args.reasoning_parser if free else None

        def make_msg(uid: int) -> TokenizeMsg:
            return TokenizeMsg(
                uid,
                params,
                messages=messages,
                tools=tools,
                add_generation_prompt=req.generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.template_kwargs(),
                reasoning=reasoning,
            )

        fmt.reasoning = reasoning is not None  # its think block is read out of the answer
        return Job(
            make_msgs=[make_msg],
            fmt=fmt,
            n=params.n,
            logprobs=req.logprobs,
            include_usage=req.include_usage,
        )

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(req: ChatCompletionRequest):
        if (refusal := unknown_model(req.model)) is not None:
            return refusal
        fmt = ChatFormat(
            model_name, req.n, req.tool_calling(), continuous_usage=req.continuous_usage
        )
        return respond(req, chat_job(req, fmt))

    # --8<-- [end:chat_route]

    @app.post("/v1/responses")
    async def v1_responses(req: ResponsesRequest):
        """The Responses API: the chat request it stands for, answered as a response."""
        if (refusal := unknown_model(req.model)) is not None:
            return refusal
        if req.user is not None:
            logger.info("request %s: user %r", request_id_var.get(), req.user)
        chat = req.chat
        return respond(chat, chat_job(chat, ResponsesFormat(model_name, req, chat.tool_calling())))

    @app.post("/v1/completions")
    async def v1_completions(req: CompletionRequest):
        if (refusal := unknown_model(req.model)) is not None:
            return refusal
        params = salted(req.sampling_params())
        limit = frontend.max_concurrent
        if len(req.prompts()) > limit:  # it could never be admitted: retrying cannot help
            message = (
                f"this request has {len(req.prompts())} prompts, more than the {limit} requests "
                "this server serves at once (--max-concurrent-requests); split it"
            )
            metrics.on_rejected("too_many_prompts")
            return HttpError(400, message, code="too_many_prompts", param="prompt").response()

        def maker(prompt: str | list[int]) -> Callable[[int], TokenizeMsg]:
            if isinstance(prompt, str):
                return lambda uid: TokenizeMsg(uid, params, text=prompt, echo=req.echo)
            packed = pack_ids(prompt)
            return lambda uid: TokenizeMsg(uid, params, input_ids_packed=packed, echo=req.echo)

        makers = [maker(p) for p in req.prompts()]
        job = Job(
            make_msgs=makers,
            fmt=CompletionFormat(model_name, len(makers) * params.n, req.continuous_usage),
            n=params.n,
            logprobs=req.logprobs is not None,
            include_usage=req.include_usage,
        )
        return respond(req, job)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "minisgl"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len  # as vLLM's model card has it

    @app.get("/v1/models")
    async def v1_models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # hub ids hold a slash: Qwen/Qwen3-0.6B
    async def v1_model(model_id: str):
        return unknown_model(model_id) or card

    @app.get("/health")
    async def health():
        return decide_health(frontend, degraded).response()

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            sched = (await frontend.lifecycle(timeout=5.0)).scheduler
        except (RequestFailed, asyncio.TimeoutError):
            sched = None  # the workers' gauges keep their last values
        body = metrics.render(len(frontend.states), sched)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/requests")
    async def debug_requests(
        limit: int = Query(100, ge=1, le=1000),
        since: int = Query(0, ge=0),
        request_id: str | None = None,
    ):
        """Timelines of the requests in flight and of the last --debug-history ended: at
        most `limit` of each, only those ended after the `since`-th end (`seq`), or only
        one request id's. The body is built from at most `limit` timelines, whatever the
        history holds, so a page polling it never stalls the server."""
        counts = {
            uid: (s.buffer.prompt_tokens, s.buffer.completion_tokens)
            for uid, s in frontend.states.items()
        }
        return timelines.snapshot(counts, limit=limit, since=since, request_id=request_id)

    @app.get("/debug", response_class=HTMLResponse)
    async def debug_page():
        """The live page: it polls /debug/lifecycle and /debug/requests."""
        return HTMLResponse(_debug_page())

    @app.get("/debug/lifecycle")
    async def debug_lifecycle():
        try:
            return msgspec.to_builtins(await frontend.lifecycle())  # unset fields left out
        except RequestFailed as failed:
            return to_http(failed.error).response()
        except asyncio.TimeoutError:
            return to_http(unavailable("a worker did not answer the state query")).response()

    # --8<-- [start:flush_cache]
    @app.post("/debug/flush_cache")
    async def debug_flush_cache():
        """Empty the prefix cache (admin). 409 while any request is in flight."""
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

    _describe_errors_as_openai(app)
    return app


@functools.cache
def _debug_page() -> str:
    return (Path(__file__).parent / "static" / "debug.html").read_text()


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
