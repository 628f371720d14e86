"""Run at start-up by a Python process whose PYTHONPATH holds this folder (a test puts it
there for the servers and tensor-parallel ranks it starts, tests/faults.py's `site_env`):
with MINISGL_INJECT_FAULTS set, every engine the process builds gets those faults."""

import os

if os.environ.get("MINISGL_INJECT_FAULTS"):
    import faults  # tests/, on the same PYTHONPATH

    faults.install()
