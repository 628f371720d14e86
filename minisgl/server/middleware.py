"""Plain ASGI middleware in front of the routes.

- `RequestIdMiddleware`: every response carries `X-Request-Id`, the client's own when it
  sent one, else a fresh one; while the request is served the id is in `request_id_var`,
  so log lines about the request can name it.
- `ApiKeyMiddleware`: with an API key set, every `/v1/*` route, the request timelines
  `GET /debug/requests` and the live page `GET /debug` require `Authorization: Bearer
  <key>` (or HTTP Basic auth with the key as the password, which a browser asks for on the
  live page and then sends with the page's own requests), compared in constant time;
  otherwise 401. The operator's routes (`POST /debug/flush_cache`, `GET /metrics`) need
  the operator's key: 401 without a key, 403 with a tenant's (tenants.py says who is
  which). /health and /debug/lifecycle stay open. Several keys (`--api-key A,B`) are
  several tenants: while a request is served, `tenant_var` holds a digest of the key it
  came with, which --cache-salt-per-key mixes into its prefix cache salt, and `role_var`
  its role. `client_var` is who sent it (that digest, else its address): the unit the
  slots are shared by. `--admin-key` alone (no --api-key) leaves /v1 open.
- `BodyLimitMiddleware`: a request body over the limit is answered 413 before any route
  reads it, whether it declares a Content-Length or streams chunks. The bodies of all the
  requests being read or served are held in memory together: past `max_total` bytes of
  them, the request whose piece crossed it is answered 503 with Retry-After (a thousand
  connections each sending a body just under the limit no longer make gigabytes).
All error answers use the OpenAI error body, and are counted through `on_reject(code)`.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException

from . import tenants
from .errors import HttpError, from_status
from .tenants import api_keys

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# (time.monotonic() when the request came in, its path): where its timeline starts
arrival_var: contextvars.ContextVar[tuple[float, str] | None] = contextvars.ContextVar(
    "arrival", default=None
)
# a digest of the API key the request came with (None: no key); never the key itself
tenant_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)
# who sent the request, for sharing the slots fairly (shares.py): its key's digest under
# --api-key, else its address
client_var: contextvars.ContextVar[str] = contextvars.ContextVar("client", default="-")
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
        arrival = arrival_var.set((time.monotonic(), scope["path"]))
        peer = scope.get("client") or ("-", 0)
        client = client_var.set(f"address {peer[0]}")

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
            arrival_var.reset(arrival)
            client_var.reset(client)


def _no_count(code: str) -> None:
    pass


PROTECTED = ("/v1/", "/debug/requests")  # path prefixes behind a key (any of ours)
PAGES = ("/debug", "/debug/")  # pages a browser opens: it is asked for Basic auth


class ApiKeyMiddleware:
    def __init__(
        self,
        app,
        api_key: str | None,
        admin_key: str | None = None,
        on_reject: Callable[[str], None] = _no_count,
    ) -> None:
        self.app = app
        self.keys = [key.encode() for key in api_keys(api_key)]
        self.admin = admin_key.strip().encode() if admin_key else None
        self.on_reject = on_reject

    def _key(self, given: bytes) -> bytes | None:
        """The key `given` (an Authorization header) carries, if it is one of ours."""
        if given[:6].lower() == b"basic ":  # a browser: any user name, the key as password
            try:
                _, _, key = base64.b64decode(given[6:].strip(), validate=True).partition(b":")
            except ValueError:
                return None
        elif given[:7].lower() == b"bearer ":
            key = given[7:]
        else:
            return None
        found = None
        for ours in [*self.keys, *([self.admin] if self.admin else [])]:
            if hmac.compare_digest(key, ours):  # every key compared, each in constant time
                found = ours
        return found

    def _refusal(self, path: str, key: bytes | None, role: str) -> HttpError | None:
        """Why the request may not reach its route (None: it may)."""
        if tenants.operator_only(path):
            if role == tenants.OPERATOR:
                return None
        elif key is not None or not self._needs_key(path):
            return None
        if key is None:
            message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            return HttpError(401, message, code="invalid_api_key")
        how = "" if self.admin else ": start the server with --admin-key to have one"
        return HttpError(403, f"this route needs the admin key{how}", code="admin_key_required")

    def _needs_key(self, path: str) -> bool:
        if path in PAGES or path.startswith(PROTECTED[1]):
            return True
        return bool(self.keys) and path.startswith(PROTECTED[0])  # --admin-key alone: /v1 open

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        key = self._key(_header(scope, b"authorization") or b"")
        role = tenants.role_of(key, self.admin, self.keys)
        error = self._refusal(path, key, role)
        if error is not None:
            self.on_reject(error.code)
            challenge = 'Basic realm="minisgl"' if path in PAGES else "Bearer"
            headers = {"WWW-Authenticate": challenge} if error.status == 401 else None
            return await error.response(headers=headers)(scope, receive, send)
        tenant = hashlib.sha256(key).hexdigest()[:16] if key is not None else None
        token, role_token = tenant_var.set(tenant), tenants.role_var.set(role)
        client = client_var.set(f"key {tenant}") if tenant is not None else None
        try:
            await self.app(scope, receive, send)
        finally:
            tenant_var.reset(token)
            tenants.role_var.reset(role_token)
            if client is not None:
                client_var.reset(client)


class BodyTooLarge(HTTPException):
    """Raised from inside receive(); an HTTPException so that FastAPI's body parsing lets it
    through (it turns other exceptions into a generic 400) to the app's error handler."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")


class BodiesTooLarge(HTTPException):
    """Raised from inside receive() when all bodies held together pass their budget."""

    def __init__(self, max_total: int) -> None:
        message = f"request bodies held at once passed {max_total} bytes: retry shortly"
        super().__init__(503, message, headers={"Retry-After": "1"})


class BodyLimitMiddleware:
    def __init__(
        self,
        app,
        max_bytes: int,
        max_total: int | None = None,
        on_reject: Callable[[str], None] = _no_count,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_total = max_total if max_total is not None else 64 * max_bytes
        self.held = 0  # body bytes received by the requests being served, all together
        self.on_reject = on_reject

    async def _refuse(self, exc: HTTPException, scope, receive, send) -> None:
        """The answer to a body refused before (or without) the app's own error handler:
        the same answer that handler gives (errors.from_status)."""
        error = from_status(exc.status_code, str(exc.detail))
        self.on_reject(str(error.code))
        await error.response(exc.headers)(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(BodyTooLarge(self.max_bytes), scope, receive, send)
        received = 0
        started = False

        async def counting_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                piece = len(message.get("body", b""))
                received += piece
                self.held += piece
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                if self.held > self.max_total:
                    raise BodiesTooLarge(self.max_total)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except (BodyTooLarge, BodiesTooLarge) as exc:
            if not started:
                await self._refuse(exc, scope, receive, send)
        finally:
            self.held -= received
