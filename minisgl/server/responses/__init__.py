"""POST /v1/responses (OpenAI's Responses API), stateless: a translation to the chat path.

Contract: the route checks the model, translates the request into the chat request it
stands for (`ResponsesRequest.chat`, request.py) and serves that exactly as
/v1/chat/completions does (the chat template, tools and their grammar, sampling, the
request scope and its lifecycle rules), answered in the Responses format (format.py).
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request

from ..chat import chat_job
from ..endpoint import unknown_model
from ..middleware import request_id_var
from ..response import respond
from .format import ResponsesFormat
from .request import ResponsesRequest, chat_messages

__all__ = ["ResponsesFormat", "ResponsesRequest", "chat_messages", "router"]

logger = logging.getLogger(__name__)
router = APIRouter()


@router.post("/v1/responses")
async def v1_responses(req: ResponsesRequest, request: Request):
    """The Responses API: the chat request it stands for, answered as a response."""
    served = request.app.state
    if (refusal := unknown_model(request, req.model)) is not None:
        return refusal
    if req.user is not None:
        logger.info("request %s: user %r", request_id_var.get(), req.user)
    chat = req.chat
    tools = served.parsers.tool_calls(chat.tool_calling())
    fmt = ResponsesFormat(served.model_name, req, tools)
    return respond(request, chat, chat_job(request, chat, fmt))
