"""Where a model comes from: `resolve_model_dir(model)` turns what the user passed to
`--model` into a local folder holding config.json, the tokenizer and the weights.

A folder is used as it is; a `.gguf` file is converted once into the cache (its quantized
blocks stay in use: models/loader.py); anything else is a hub id, downloaded (config, tokenizer and
safetensors only); `None` is the embedded default model. Imports no torch: the API server
process resolves the model before it starts the workers.
"""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str | Path | None) -> Path:
    if model is None:
        from .default_model import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    if path.suffix == ".gguf":  # converted once into the cache, like the default model
        from .default_model import gguf_model_dir

        return gguf_model_dir(path)
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            str(model),
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
        )
    except Exception as exc:  # network, auth or a wrong id: say which and why in one line
        raise RuntimeError(
            f"could not load model {model!r}: not a local folder and the hub download failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return Path(local)
