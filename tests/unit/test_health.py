"""/health decided in one place (minisgl/server/health.py) from the supervisor's state:
unavailable when a worker died, the server drains or a worker is silent past its heartbeat
timeout (the supervisor's `silent_worker`, asked by the frontend); degraded when the engine
fell back; ok otherwise, a busy server included."""

from __future__ import annotations

import time
from types import SimpleNamespace

from minisgl.message import ErrorInfo, ErrorKind
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import FrontendManager
from minisgl.server.health import decide_health
from minisgl.server.supervisor import Supervisor, Worker
from minisgl.testing.fakes import FakeBackend

FELL_BACK = {"triton": "triton decode: max error 0.5"}


def _frontend(**options) -> FrontendManager:
    backend = FakeBackend()
    return FrontendManager(backend.send, backend.recv, **options)


def _supervisor(silent_s: dict[str, float], timeout: float = 1.5) -> Supervisor:
    """A supervisor whose workers last beat `silent_s[name]` seconds ago (no processes)."""
    supervisor = Supervisor(ServerArgs(worker_heartbeat_timeout=timeout))
    now = time.monotonic()
    for name, silent in silent_s.items():
        beat = SimpleNamespace(value=now - silent)
        supervisor.workers[name] = Worker(name, None, None, beat)
    return supervisor


def test_a_serving_server_is_ok_and_says_degraded_only_when_it_fell_back():
    frontend = _frontend()
    assert decide_health(frontend, {}).status == "ok"
    assert decide_health(frontend, {}).response() == {"status": "ok"}
    degraded = decide_health(frontend, FELL_BACK)
    assert degraded.status == "degraded"
    assert degraded.response() == {"status": "ok", "degraded": FELL_BACK}


def test_a_busy_server_is_still_healthy():
    frontend = _frontend(max_concurrent=1)
    frontend.new_user()  # one request in flight: at the limit
    assert decide_health(frontend, {}).status == "ok"


def test_a_dead_worker_or_a_drain_is_unavailable_with_the_reason():
    frontend = _frontend()
    frontend.draining = True
    health = decide_health(frontend, FELL_BACK)
    assert health.status == "unavailable" and health.error.kind is ErrorKind.SHUTTING_DOWN
    assert health.response().status_code == 503
    frontend = _frontend()
    frontend.fail_all(ErrorInfo(ErrorKind.BACKEND_UNAVAILABLE, "the scheduler process died"))
    health = decide_health(frontend, {})
    assert health.status == "unavailable" and "scheduler process died" in health.error.message


def test_a_worker_silent_past_its_heartbeat_timeout_is_unavailable_until_it_beats():
    supervisor = _supervisor({"scheduler": 0.2, "tokenizer": 3.0})
    frontend = _frontend(worker_fault=supervisor.silent_worker)
    health = decide_health(frontend, {})
    assert health.status == "unavailable" and health.error.kind is ErrorKind.BACKEND_UNAVAILABLE
    assert health.error.message.startswith("the tokenizer process has not answered for 3.")
    supervisor.workers["tokenizer"].heartbeat.value = time.monotonic()  # it beats again
    assert decide_health(frontend, {}).status == "ok"


def test_the_supervisor_names_the_degraded_parts_its_scheduler_reported():
    supervisor = _supervisor({"scheduler": 0.0})
    assert supervisor.degraded == {}
    supervisor.workers["scheduler"].info = {"max_seq_len": 2048, "degraded": FELL_BACK}
    assert supervisor.degraded == FELL_BACK
