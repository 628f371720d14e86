"""The chapter's real outputs: one session against one real server, run by every site build.

Contract: `run(out)` starts `python -m minisgl --device cpu` (the embedded default model) on
a free port, once, sends it the requests the chapter's pages show, in the order the pages
tell them, and writes under `out` what came back, one file per sample, for the pages to
include (pymdownx.snippets, `--8<-- "chapters/generated/samples/NAME"`):
- `NAME.sh`: the command a reader types (rendered from the very body that was sent), and
  `NAME.txt`: what it printed: SSE streams byte for byte, status lines, headers and bodies
  as `curl -i` shows them, JSON as the server wrote it (architecture/rules-5-7.md's idle
  /debug/lifecycle alone is indented, one field a line);
- `NAME.md`: a sentence or two of Chinese prose stating this run's figures (token counts,
  pages), for the places where a page explains the numbers of a sample;
- `live.json`: the server's own JSON (the /debug/lifecycle state, every chunk of a chat
  stream, the /metrics text), which the site test compares with the pages' field tables;
- `manifest.json`: when the session ran, the server's command, the commit.
Then `python -m minisgl --shell` is driven through a pseudo-terminal for the shell's
transcript (the shell runs its own workers: a second start of the model).

The samples show the default address 127.0.0.1:1919, which the pages' commands use, in
place of the free port the server ran on; nothing else is edited. Any failure (a request
that does not answer as the session expects) raises, naming the step: the build fails
rather than show a wrong sample. `placeholders(out)` writes stand-ins for a preview build
that skips the run (MINISGL_SITE_EXECUTE=0).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "chapters" / "examples"
log = logging.getLogger(f"mkdocs.plugins.{__name__}")
SHOWN = "127.0.0.1:1919"  # the address the pages' commands use
QUESTION = "什么是 KV Cache？"
FRANCE = "What is the capital of France?"
LONG = {"stream": True, "max_tokens": 8}  # with a prompt longer than the context

# every sample a page includes, so that a preview build (no run) can stand in for them
TEXTS = [
    "startup", "stream", "full", "error-model", "error-type", "error-functions",
    "error-too-long", "openai", "lifecycle-busy", "lifecycle-after", "cached-usage",
    "metrics-prefix", "flush", "metrics", "health", "tools", "shell", "usage-stream",
    "lifecycle-idle", "blocking", "full-response", "responses", "prompt-scores",
]  # fmt: skip
COMMANDS = [
    "stream", "full", "error-model", "error-type", "error-functions", "error-too-long",
    "cached-usage", "tools", "usage-stream", "responses", "prompt-scores",
]  # fmt: skip
PROSE = ["stream", "full", "lifecycle-after", "cached-usage", "metrics", "usage-stream", "run"]


# ---------------------------------------------------------------- rendering
def curl(path: str, body: dict | None = None, *flags: str) -> str:
    """The curl command a reader types for `body` (the very dict the session sends)."""
    parts = ["curl", *flags, f"http://{SHOWN}{path}"]
    if body is None:
        return " ".join(parts) + "\n"
    data = json.dumps(body, ensure_ascii=False, indent=2).replace("'", "'\\''")
    return " ".join(parts) + ' \\\n  -H "Content-Type: application/json" \\\n' + f"  -d '{data}'\n"


def status_line(r) -> str:
    return f"{r.http_version} {r.status_code} {r.reason_phrase}"


def with_headers(r) -> str:
    """A response as `curl -i` prints it: status line, headers, blank line, body."""
    head = [status_line(r), *(f"{k}: {v}" for k, v in r.headers.items())]
    return "\n".join(head) + "\n\n" + r.text + "\n"


def data_events(raw: str) -> list[dict | str]:
    """The payloads of an SSE body: parsed JSON, or the literal `[DONE]`."""
    from minisgl.testing.sse import DONE, sse_payloads

    return [p if p == DONE else json.loads(p) for p in sse_payloads(raw)]


def finish_reason(events: list) -> str:
    """The finish_reason of the (one) choice of a chat stream."""
    return next(
        c["finish_reason"]
        for e in events
        if isinstance(e, dict)
        for c in e["choices"]
        if c["finish_reason"]
    )


def text_chunks(events: list) -> int:
    return sum(
        1
        for e in events
        if isinstance(e, dict) and any(c["delta"].get("content") for c in e["choices"])
    )


def chunks_against_tokens(tokens: int, n_text: int, reason: str) -> str:
    """The sentence under the 4.4 sample: why its text chunks are fewer than its tokens."""
    said = (
        f"这次生成了 {tokens} 个 token（`usage.completion_tokens`），带文本的数据块有 {n_text} 个"
    )
    eos = 1 if reason == "stop" and n_text < tokens else 0
    merged = tokens - n_text - eos
    why = []
    if eos:
        why.append(f"最后一个 token 是 EOS，只带来了 `{reason}`，不产生文本")
    if merged > 0:
        why.append(
            f"{'另外' if eos else '其中'} {merged} 个 token 的文本和别的 token 进了同一个数据块"
            "（客户端还没读走上一块时，"
            "缓冲区把新来的文本合在一起，见第 3.1 节；半个 UTF-8 字符也要等下一个 token 补全）"
        )
    return said + ("：" + "；".join(why) if why else f"，结束原因是 `{reason}`") + "。"


# ---------------------------------------------------------------- the session
class Session:
    def __init__(self, out: Path) -> None:
        import httpx

        from minisgl.testing.server import RunningServer

        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            old.unlink()
        self.started = time.time()
        self.server = RunningServer(None)
        self.port = self.server.port
        self.http = httpx.Client(base_url=self.server.base_url, timeout=600)  # a loaded machine
        self.model = self.server.model_name
        self.live: dict = {}

    def shown(self, text: str) -> str:
        return text.replace(f"127.0.0.1:{self.port}", SHOWN)

    def write(self, name: str, text: str) -> None:
        log.debug("sample %s after %.1f s", name, time.time() - self.started)
        (self.out / name).write_text(self.shown(text).rstrip("\n") + "\n", encoding="utf-8")

    def chat(self, content: str = QUESTION, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], **extra}

    def post(self, body: dict):
        return self.http.post("/v1/chat/completions", json=body)

    def exchange(self, name: str, path: str, body: dict):
        """`body` posted to `path`, a 200 expected: `NAME.sh` the command, `NAME.txt` the body."""
        self.write(f"{name}.sh", curl(path, body))
        r = self.http.post(path, json=body)
        assert r.status_code == 200, (name, r.status_code, r.text)
        self.write(f"{name}.txt", r.text)
        return r

    def stream_raw(self, body: dict) -> str:
        with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, (r.status_code, r.read())
            return b"".join(r.iter_raw()).decode()

    def lifecycle(self) -> dict:
        return self.server.lifecycle()

    def metrics_lines(self, *prefixes: str) -> list[str]:
        text = self.http.get("/metrics").text
        return [ln for ln in text.splitlines() if ln.startswith(prefixes)]

    def close(self) -> None:
        self.http.close()
        code = self.server.stop()
        assert code == 0, f"the sample server exited with {code}:\n{self.server.log()[-3000:]}"


def run(out: Path) -> None:
    """Run the whole session (see the module docstring) and write its samples into `out`."""
    blocking = subprocess.Popen(  # independent of the server: runs meanwhile
        [sys.executable, str(EXAMPLES / "blocking.py")], stdout=subprocess.PIPE, text=True
    )
    full = subprocess.run(
        [sys.executable, str(EXAMPLES / "full_response.py")], capture_output=True, text=True
    )
    assert full.returncode == 0, f"chapters/examples/full_response.py failed:\n{full.stderr}"
    s = Session(out)
    try:
        _http_session(s)
    finally:
        s.close()
    s.write("blocking.txt", blocking.communicate(timeout=120)[0])
    assert blocking.returncode == 0, "chapters/examples/blocking.py failed"
    s.write("full-response.txt", full.stdout)
    s.write("shell.txt", shell_transcript())
    (out / "live.json").write_text(json.dumps(s.live, ensure_ascii=False, indent=1))
    manifest = {
        "started_at": s.started,
        "finished_at": time.time(),
        "server": " ".join(["python", *s.server.cmd[1:]]).replace(f" --port {s.port}", ""),
        "model": s.model,
        "commit": _commit(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.started))
    s.write(
        "run.md",
        f"本页的输出都来自构建本站时的同一次真实运行（{when}，提交 `{manifest['commit'][:12]}`，"
        f"`{manifest['server']}`，内置默认模型 {s.model}，CPU）；"
        f"服务跑在一个空闲的端口上，输出里的这个端口换成了命令里用的默认地址 `{SHOWN}`，"
        "此外一字未改。id、时间戳、生成的文字每次构建都不同。",
    )


def _http_session(s: Session) -> None:
    log = s.server.log().splitlines()
    first = next(i for i, ln in enumerate(log) if "tokenizer ready" in ln)
    last = next(i for i, ln in enumerate(log) if "Uvicorn running" in ln)
    keep = [
        ln for ln in log[first : last + 1] if "ready" in ln or "serving" in ln or "Uvicorn" in ln
    ]
    s.write("startup.txt", "\n".join(keep))

    # -------- running.md: curl -N, a stream
    body = s.chat(max_tokens=16, stream=True)
    s.write("stream.sh", curl("/v1/chat/completions", body, "-N"))
    raw = s.stream_raw(body)
    s.write("stream.txt", raw)
    events = data_events(raw)
    reason = finish_reason(events)
    s.write(
        "stream.md",
        f"这次的结束原因是 `{reason}`"
        + ("，因为达到了 `max_tokens`（16 个 token）" if reason == "length" else "")
        + f"；带文本的数据块有 {text_chunks(events)} 个。",
    )

    # -------- the same, not streaming, with headers
    body = s.chat(max_tokens=16)
    s.write("full.sh", curl("/v1/chat/completions", body, "-i"))
    r = s.post(body)
    assert r.status_code == 200, r.text
    s.write("full.txt", with_headers(r))
    usage = r.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    s.write(
        "full.md",
        f"这次 prompt 套上聊天模板后是 {usage['prompt_tokens']} 个 token，生成了 "
        f"{usage['completion_tokens']} 个；其中 {cached} 个 prompt token 的 K/V 直接取自"
        "前缀缓存（`prompt_tokens_details.cached_tokens`）：上一个请求问的是同一个问题，"
        "见下文的「前缀缓存」。",
    )

    # -------- errors
    errors = {
        "error-model": {**s.chat("hi", stream=True), "model": "gpt-4o"},
        "error-type": s.chat(max_tokens="16"),
        "error-functions": s.chat(functions=[{"name": "get_weather", "parameters": {}}]),
        "error-too-long": s.chat("word " * 9000, **LONG),
    }
    for name, body in errors.items():
        command = curl("/v1/chat/completions", body, "-s", "-i")
        if name == "error-too-long":  # 9000 words: shortened on the page, said so
            shown = curl("/v1/chat/completions", s.chat("word word … word", **LONG), "-s", "-i")
            command = '# the content is "word " 9000 times, shortened here\n' + shown
        s.write(f"{name}.sh", command)
        r = s.post(body)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        s.write(f"{name}.txt", f"{status_line(r)}\n{r.text}")

    # -------- the official client: the example file, run with the server's port
    code = (EXAMPLES / "openai_client.py").read_text().replace(SHOWN, f"127.0.0.1:{s.port}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"chapters/examples/openai_client.py failed:\n{done.stderr}"
    s.write("openai.txt", done.stdout)

    # -------- /debug/lifecycle during a long stream, and after the client left
    busy = s.chat(max_tokens=256, stream=True, ignore_eos=True)
    with s.http.stream("POST", "/v1/chat/completions", json=busy) as r:
        from minisgl.testing.sse import iter_payloads

        payloads = iter_payloads(r.iter_lines())
        for _ in range(3):
            next(payloads)
        during = s.http.get("/debug/lifecycle")
    assert during.json()["frontend"]["requests"] == 1, during.text
    s.write("lifecycle-busy.txt", during.text)
    s.server.wait_zero(timeout=60)  # the client left: every count back at zero
    r = s.http.get("/debug/lifecycle")
    s.write("lifecycle-after.txt", r.text)
    after = s.live["lifecycle"] = r.json()
    sched = after["scheduler"]
    s.write(
        "lifecycle-after.md",
        f"这时 `kv_pages_cached` 是 {sched['kv_pages_cached']}：这次运行到现在为止的几个请求"
        f"（prompt 和正常结束的请求生成的内容）留在前缀缓存里的整页，树上共 "
        f"{sched['prefix_cache_nodes']} 个节点；没有请求持有它们，`kv_pages_used` 已经是 0。",
    )

    # -------- the prefix cache: the first question once more
    again = s.chat(max_tokens=16)
    s.write("cached-usage.sh", curl("/v1/chat/completions", again))
    r = s.post(again)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    s.write("cached-usage.txt", json.dumps(usage, ensure_ascii=False))
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    page = 16
    s.write(
        "cached-usage.md",
        f"{usage['prompt_tokens']} 个 prompt token 里，{cached} 个（{cached // page} 个整页，"
        f"每页 {page} 个 token）直接用了缓存里的 K/V；其余的要重新算："
        "prompt 的最后一个 token 所在的那一页总要自己算，因为这一步要从它的输出采样。",
    )
    prefix = s.metrics_lines(
        "minisgl_kv_cache_usage_perc",
        "minisgl_kv_pages_cached",
        "minisgl_prefix_cache_queries_total",
        "minisgl_prefix_cache_hits_total",
    )
    s.write("metrics-prefix.txt", "\n".join(prefix))

    # -------- tools
    tools = {
        "messages": [{"role": "user", "content": "What is the weather in Paris today?"}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather in a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    r = s.exchange("tools", "/v1/chat/completions", tools)
    assert r.json()["choices"][0]["message"]["tool_calls"], r.text

    # -------- running.md: the Responses API, and scoring a prompt (echo, max_tokens 0)
    asked = {
        "model": s.model,
        "instructions": "Answer in one sentence.",
        "input": FRANCE,
        "max_output_tokens": 32,
        "temperature": 0,
    }
    r = s.exchange("responses", "/v1/responses", asked)
    assert r.json()["status"] in ("completed", "incomplete"), r.text
    scored = {
        "model": s.model,
        "prompt": "The capital of France is Paris",
        "echo": True,
        "logprobs": 1,
        "max_tokens": 0,
    }
    r = s.exchange("prompt-scores", "/v1/completions", scored)
    assert r.json()["choices"][0]["logprobs"]["tokens"], r.text

    # -------- the chapter's SSE anatomy (4.4): include_usage, greedy
    body = s.chat(FRANCE, temperature=0, stream=True, stream_options={"include_usage": True})
    s.write("usage-stream.sh", curl("/v1/chat/completions", body, "-N"))
    raw = s.stream_raw(body)
    s.write("usage-stream.txt", raw)
    events = data_events(raw)
    s.live["chat_chunks"] = [e for e in events if isinstance(e, dict)]
    final = events[-2]["usage"]
    reason = finish_reason(events)
    n_text = text_chunks(events)
    s.write("usage-stream.md", chunks_against_tokens(final["completion_tokens"], n_text, reason))

    # -------- the whole run, as /metrics counts it; /health; the idle state
    s.write(
        "metrics.txt",
        "\n".join(
            s.metrics_lines(
                "minisgl_requests_total",
                "minisgl_client_disconnects_total",
                "minisgl_requests_in_flight",
                "minisgl_kv_pages_used",
                "minisgl_kv_pages_total",
            )
        ),
    )
    s.live["metrics"] = s.http.get("/metrics").text
    finished = next(
        float(ln.split()[-1])
        for ln in s.metrics_lines('minisgl_requests_total{code="",outcome="finished"}')
    )
    s.write(
        "metrics.md",
        f"这是这次运行做完上面各节的例子之后的计数：正常完成的 {finished:.0f} 个请求"
        "（`finished`），四个错误的例子（`error`，按错误码分开），"
        "中途断开的那个流式请求（`aborted_client`）。",
    )
    r = s.http.get("/health")
    s.write("health.txt", f"{status_line(r)}\n{r.text}")
    s.write("lifecycle-idle.txt", json.dumps(s.lifecycle(), ensure_ascii=False, indent=1))

    # -------- flush the cache last: the samples above show it full
    r = s.http.post("/debug/flush_cache")
    assert r.status_code == 200, r.text
    s.write("flush.txt", r.text)


def shell_transcript() -> str:
    """`python -m minisgl --shell` in a pseudo-terminal: what its screen shows."""
    import pexpect

    child = pexpect.spawn(
        sys.executable,
        ["-m", "minisgl", "--shell", "--device", "cpu", "--max-tokens", "48"],
        cwd=str(ROOT),
        encoding="utf-8",
        codec_errors="replace",
        timeout=600,  # start-up, and an answer, on a loaded machine
        dimensions=(40, 200),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        child.expect_exact("/exit quits.")
        screen = "Type a message." + child.before.split("Type a message.", 1)[1] + "/exit quits."
        for line in (FRANCE, "/lifecycle", "/exit"):
            child.expect_exact(">>> ")
            screen += child.before + ">>> "
            child.sendline(line)
        child.expect(pexpect.EOF)
        screen += child.before
    finally:
        child.close(force=True)
    return re.sub(r"\r\n?", "\n", screen)


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:  # no git: a copy of the tree, not a clone
        return "unknown"
    return done.stdout.strip() or "unknown"


def placeholders(out: Path) -> None:
    """Stand-ins for a preview build without the run; real samples are left as they are."""
    out.mkdir(parents=True, exist_ok=True)
    note = "（这段输出在完整构建时由真实的服务生成；这次是不运行服务的预览构建。）"
    names = [f"{n}.txt" for n in TEXTS] + [f"{n}.sh" for n in COMMANDS] + [f"{n}.md" for n in PROSE]
    for name in names:
        if not (out / name).exists():
            (out / name).write_text(note + "\n", encoding="utf-8")
