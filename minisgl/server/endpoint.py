"""What every route shares: the app's state it reads, the served model's check, the cache
salt of the request's tenant, and a refusal that is counted.

Contract: a route reaches the server through `request.app.state` (set by `create_app`):
`frontend`, `args`, `model_name`, `parsers`. `unknown_model(request, model)` is the 404
for a model this server does not serve (None: served, or not named). `salted(request,
params)` adds the request's tenant to its cache salt under --cache-salt-per-key, so tenants
with different API keys never share cached prefix pages. `refused(...)` answers an error
before the request reached the backend, and tells the frontend's observers (the metrics
count it by its code).
"""

from __future__ import annotations

from fastapi import Request
from starlette.responses import Response

from minisgl.core import SamplingParams

from .errors import HttpError
from .middleware import tenant_var


def refused(
    request: Request, status: int, message: str, code: str, param: str | None = None
) -> Response:
    request.app.state.frontend.observer.event(None, "refused", code=code)
    return HttpError(status, message, code=code, param=param).response()


def unknown_model(request: Request, model: str | None) -> Response | None:
    served = request.app.state.model_name
    if model is None or model == served:  # None: omitted, the served one
        return None
    message = f"the model {model!r} does not exist; this server serves {served!r}"
    return refused(request, 404, message, code="model_not_found", param="model")


def salted(request: Request, params: SamplingParams) -> SamplingParams:
    tenant = tenant_var.get()
    if request.app.state.args.cache_salt_per_key and tenant is not None:
        params.cache_salt = f"{tenant}:{params.cache_salt or ''}"
    return params
