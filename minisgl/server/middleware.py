"""Plain ASGI middleware in front of the routes.

- `RequestIdMiddleware`: every response carries `X-Request-Id`, the client's own when it
  sent one, else a fresh one; while the request is served the id is in `request_id_var`,
  so log lines about the request can name it.
- `ApiKeyMiddleware`: with an API key set, every `/v1/*` route and the admin route
  `POST /debug/flush_cache` require `Authorization: Bearer <key>`, compared in constant
  time; otherwise 401. Other routes (/health, /metrics, /debug/lifecycle) stay open.
- `BodyLimitMiddleware`: a request body over the limit is answered 413 before any route
  reads it, whether it declares a Content-Length or streams chunks.
All error answers use the OpenAI error body, and are counted through `on_reject(code)`.
"""

from __future__ import annotations

import contextvars
import hmac
import re
import uuid
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException

from .errors import HttpError

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class RequestIdMiddleware:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        request_id = given if _VALID_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(request_id)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def _no_count(code: str) -> None:
    pass


PROTECTED = ("/v1/", "/debug/flush_cache")  # path prefixes behind the API key


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str, on_reject: Callable[[str], None] = _no_count) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            given = _header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, self.expected):  # constant time
                self.on_reject("invalid_api_key")
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                error = HttpError(401, message, code="invalid_api_key")
                response = error.response(headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyTooLarge(HTTPException):
    """Raised from inside receive(); an HTTPException so that FastAPI's body parsing lets it
    through (it turns other exceptions into a generic 400) to the app's error handler."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, on_reject: Callable[[str], None] = _no_count) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def _too_large(self, scope, receive, send) -> None:
        self.on_reject("body_too_large")
        message = str(BodyTooLarge(self.max_bytes).detail)
        await HttpError(413, message, code="body_too_large").response()(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        received = 0
        started = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._too_large(scope, receive, send)
