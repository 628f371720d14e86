"""Helpers shared by the quiz tests: the real FastAPI app over a FakeBackend.

`app_client(frontend)` runs the app from `create_app` (lifespan included, so the listener
runs) and yields an httpx client that calls it in this event loop through
`httpx.ASGITransport`: no sockets, no threads, no model. `answer(backend, pieces)` makes
the FakeBackend answer every TokenizeMsg with one UserReply per piece, then a terminal one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import httpx

from minisgl.message import LifecycleStateMsg, TokenizeMsg, UserReply
from minisgl.server.api_server import create_app
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import FrontendManager
from minisgl.testing.fakes import FakeBackend, scheduler_state

MODEL = "quiz-model"


def app_for(frontend: FrontendManager, model: str = MODEL):
    return create_app(ServerArgs(), model, frontend)


@asynccontextmanager
async def app_client(frontend: FrontendManager, wrap=None) -> AsyncIterator[httpx.AsyncClient]:
    """`wrap`, if given, wraps the ASGI app the client calls (e.g. to record its sends)."""
    app = app_for(frontend)
    async with app.router.lifespan_context(app):  # starts frontend.listen()
        transport = httpx.ASGITransport(app=wrap(app) if wrap else app)
        async with httpx.AsyncClient(transport=transport, base_url="http://quiz") as client:
            yield client


def answer(backend: FakeBackend, pieces: Sequence[str], finish_reason: str = "stop") -> None:
    """Answer each TokenizeMsg with one reply per piece (one batch each), then the end."""
    tasks: set[asyncio.Task] = set()

    async def play(uid: int) -> None:
        for i, piece in enumerate(pieces):
            backend.inject(UserReply(uid, piece, prompt_tokens=5, completion_tokens=i + 1))
            await asyncio.sleep(0)
        backend.inject(
            UserReply(
                uid,
                finished=True,
                finish_reason=finish_reason,
                prompt_tokens=5,
                completion_tokens=len(pieces),
            )
        )

    def on_tokenize(msg: TokenizeMsg) -> None:
        task = asyncio.get_running_loop().create_task(play(msg.uid))
        tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(tasks.discard)

    backend.on_tokenize = on_tokenize


def answer_queries(backend: FakeBackend) -> None:
    """Answer /debug/lifecycle's state query as idle workers would."""
    backend.on_query = lambda q: backend.inject(
        LifecycleStateMsg(q.query_id, {"decode_states": 0}, scheduler_state())
    )


def chat_body(stream: bool = False, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "什么是 KV Cache？"}],
        "stream": stream,
        **extra,
    }
