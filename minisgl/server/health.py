"""What GET /health answers, decided in one place.

Contract: `decide_health(frontend, degraded)` is `unavailable` (503, the error body of the
reason) when no request could be served now whatever the load: a worker died, the server is
draining, or a worker is silent past its heartbeat timeout (the supervisor's state, which
the frontend holds or asks for: `FrontendManager.refusal`); `degraded` (200, `{"status":
"ok", "degraded": {part: why}}`) when serving on a slower path the engine's start-up
self-check fell back to; `ok` (200, `{"status": "ok"}`) otherwise. A busy server (at
--max-concurrent-requests) is still healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from starlette.responses import Response

from minisgl.message import ErrorInfo

from .errors import to_http
from .frontend import FrontendManager


@dataclass(frozen=True)
class Health:
    status: Literal["ok", "degraded", "unavailable"]
    error: ErrorInfo | None = None  # unavailable: why
    degraded: dict[str, str] = field(default_factory=dict)  # degraded: part -> why

    def response(self) -> Response | dict:
        if self.error is not None:
            return to_http(self.error).response()
        if self.degraded:
            return {"status": "ok", "degraded": self.degraded}
        return {"status": "ok"}


def decide_health(frontend: FrontendManager, degraded: dict[str, str]) -> Health:
    if (refused := frontend.refusal()) is not None:
        return Health("unavailable", error=refused)
    if degraded:
        return Health("degraded", degraded=dict(degraded))
    return Health("ok")
