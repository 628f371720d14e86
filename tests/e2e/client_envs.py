"""Virtual environments of their own for clients whose pins clash with this project's.

`client_python(name)` returns the interpreter of `.venv/clients/<name>` (inside the venv
the tests run in, so `make clean` removes it), created on first use with `python -m venv`
and pip from the package index, and reused while its requirements stay the same.
`run_client(name, script, server)` runs one of client_scripts/ there against `server`:
the script exits non-zero (with its traceback) if the client's typical use fails.

- instructor pins jiter below what the current openai client needs, so pip would
  downgrade openai for it;
- the 1.x openai client (the shape of many programs still running) needs an httpx older
  than this environment's.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from minisgl.testing.server import RunningServer

REQUIREMENTS = {
    "instructor": ["instructor==1.17.0", "openai==3.3.0"],
    "openai1": ["openai==1.40.0", "httpx==0.27.2"],
}
SCRIPTS = Path(__file__).parent / "client_scripts"


def client_python(name: str) -> Path:
    requirements = REQUIREMENTS[name]
    root = Path(sys.prefix) / "clients" / name
    python = root / "bin" / "python"
    stamp = root / ".requirements"
    wanted = hashlib.sha256("\n".join(requirements).encode()).hexdigest()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run([*pip, *requirements], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"pip could not install {requirements}:\n{done.stderr[-3000:]}"
    stamp.write_text(wanted)
    return python


def run_client(name: str, script: str, server: RunningServer, timeout: float = 600) -> str:
    """Run client_scripts/`script` in the `name` environment; returns its output."""
    done = subprocess.run(
        [
            str(client_python(name)),
            str(SCRIPTS / script),
            server.base_url + "/v1",
            server.model_name,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout
