"""The doctor's checks: the machine, then the self-check at several shapes.

Contract: `environment(device)` describes the device and the software; `run_all(device,
env)` returns `{"environment", "checks", "not_checked"}`, every check a
`CheckResult.as_dict()` with a unique `name` and a `group`, every entry of `not_checked` a
`{"name", "reason"}`. Nothing raises for a failing check: a kernel that does not compile is
a failed check with the exception as its detail.

Shapes: the attention backends at head dims 64 and 128, GQA ratios 1, 4 and 8 (query heads
per KV head) and pages of 1 and 16 tokens, decode batches across the CUDA-graph buckets, in
bfloat16 and float16, each on a pool of its own (attention/check.py); then an engine per
dtype over a small random model (two layers) whose start-up self-check runs as it would
when serving: attention at its shape, every graph bucket, overlapped steps. On a CPU the
Triton kernels run in Triton's interpreter, at shorter lengths and smaller batches.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
HEAD_DIMS = (64, 128)
GQA_RATIOS = (1, 4, 8)
PAGE_SIZES = (1, 16)

# a small random model per dtype for the engine checks: Qwen3-0.6B's attention on a GPU
ENGINE_MODEL = {
    "cuda": dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=8192),
    "cpu": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=512),
}  # fmt: skip


def environment(device: torch.device) -> dict:
    """The device, the driver and the versions that decide whether the fast path works."""
    triton_version = triton_error = None
    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # not installed, or installed and broken: say which
        triton_error = f"{type(exc).__name__}: {exc}"
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # what torch was built against
        "triton": triton_version,
        "triton_error": triton_error,  # why it could not be imported
        "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "device": {"type": device.type},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device"].update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            driver=_driver_version(),
        )
    else:
        env["device"].update(name=platform.processor() or platform.machine(), cpus=os.cpu_count())
    return env


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            )  # fmt: skip
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    try:  # the CUDA version the driver supports, e.g. 12080
        v = torch._C._cuda_getDriverVersion()
        return f"CUDA {v // 1000}.{v % 1000 // 10} driver API"
    except Exception:
        return None


def interpreter_computes(dtype: torch.dtype) -> float | None:
    """Triton's interpreter on a CPU: the error of a 16x16 `tl.dot` in `dtype` against
    torch (None: exact enough). Some versions compute bfloat16 on its raw bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def _square(x, out, N: tl.constexpr):
        o = tl.arange(0, N)
        a = tl.load(x + o[:, None] * N + o[None, :])
        tl.store(out + o[:, None] * N + o[None, :], tl.dot(a, a))

    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = torch.empty(16, 16)
    _square[(1,)](x, out, N=16)
    err = (out - x.float() @ x.float()).abs().max().item()
    return None if err < 0.1 else err


def attention_grid(device: torch.device, triton_ok: bool, skip_triton: set[str]):
    """(group, backend) for each backend at every shape of the grid, on a pool of its own."""
    from minisgl.attention import create_attention_backend
    from minisgl.kvcache import KVCachePool

    cuda = device.type == "cuda"
    # query heads: 8, 32 and 64 on a GPU (Llama-3-8B has 32 over 8 KV heads); in the
    # interpreter, where every program runs in Python, 1, 4 and 8
    num_kv_heads = 8 if cuda else 1
    tokens = 65536 if cuda else 1024  # pool size; the check's lengths fit in it
    for dtype_name, dtype in DTYPES.items():
        for D in HEAD_DIMS:
            for G in GQA_RATIOS:
                for ps in PAGE_SIZES:
                    group = f"attention {dtype_name} D={D} G={G} page={ps}"
                    H = num_kv_heads * G
                    for name in ("triton", "torch"):
                        if name == "triton" and (not triton_ok or dtype_name in skip_triton):
                            continue
                        pool = KVCachePool(1, tokens // ps, ps, num_kv_heads, D, dtype, device)
                        yield group, create_attention_backend(name, pool, H, D, device)


def run_all(device: torch.device, env: dict, progress: Callable | None = None) -> dict:
    from minisgl.attention.check import check_attention

    cuda = device.type == "cuda"
    checks: list[dict] = []
    not_checked: list[dict] = []

    def skip(name: str, reason: str) -> None:
        not_checked.append({"name": name, "reason": reason})

    triton_ok = env["triton"] is not None
    skip_triton: set[str] = set()
    if not triton_ok:
        skip("triton", f"triton is not installed or cannot be imported ({env['triton_error']}): "
             "only the torch attention backend was checked")  # fmt: skip
    elif not cuda:
        skip(
            "triton on a GPU",
            "no CUDA device: the Triton kernels ran in Triton's interpreter (numpy on the "
            "CPU), which checks their arithmetic but not what a GPU compiler does with them",
        )
        for dtype_name, dtype in DTYPES.items():
            if (err := interpreter_computes(dtype)) is not None:
                skip_triton.add(dtype_name)
                skip(
                    f"triton {dtype_name}",
                    f"this Triton's interpreter computes tl.dot on {dtype_name} wrongly (a 16x16 "
                    f"product off by {err:.3g}), so its kernels cannot be checked here",
                )
    sizes = (
        {"decode_batches": (1, 3, 16, 64, 160, 256), "max_len": 4096}
        if cuda
        else {"decode_batches": (1, 3), "max_len": 40}
    )
    for group, backend in attention_grid(device, triton_ok, skip_triton):
        name = "triton" if type(backend).__name__ == "TritonBackend" else "torch"
        for result in check_attention(backend, name, **sizes):
            checks.append(_entry(group, result))
        del backend
        if progress:
            progress(checks)
    if cuda:
        torch.cuda.empty_cache()
    checks += engine_checks(device, triton_ok, skip_triton, skip, progress, checks)
    if not cuda:
        skip("cuda_graph capture", "no CUDA device: the decode graph buffers were run eagerly")
        skip("overlap on a GPU", "no CUDA device: a CPU step completes when it is launched, so "
             "overlap was checked without real asynchrony")  # fmt: skip
    return {"environment": env, "checks": checks, "not_checked": not_checked}


def _entry(group: str, result) -> dict:
    entry = result.as_dict()
    entry["group"] = group
    entry["name"] = f"{group}: {result.name}"
    return entry


def engine_checks(
    device, triton_ok: bool, skip_triton: set[str], skip, progress, done: list[dict]
) -> list[dict]:
    """The start-up self-check of an engine over a small random model, per dtype (with the
    Triton backend wherever triton is installed, as on a GPU)."""
    try:
        from minisgl.engine.build import build_engine
        from minisgl.engine.config import EngineConfig
    except ImportError as exc:  # msgspec, for the engine's messages
        skip("engine", f"the engine cannot be imported here ({exc}): pip install msgspec")
        return []
    cuda = device.type == "cuda"
    shape = ENGINE_MODEL[device.type]
    out: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="minisgl-doctor-") as tmp:
        model_dir = write_config(Path(tmp), {"num_hidden_layers": 2, **shape})
        for dtype_name in DTYPES:
            group = (
                f"engine {dtype_name} ({shape['num_attention_heads']} heads, "
                f"{shape['num_key_value_heads']} KV heads, head dim {shape['head_dim']})"
            )
            if dtype_name in skip_triton:
                skip(group, f"the Triton kernels cannot be checked in {dtype_name} here")
                continue
            config = EngineConfig(
                model=str(model_dir), device=device.type, dtype=dtype_name, dummy_weights=True,
                page_size=16 if cuda else 4, num_pages=4096 if cuda else 64,
                max_running_requests=256 if cuda else 4, max_seq_len=2048 if cuda else 64,
                attention_backend="triton" if triton_ok else "torch",
            )  # fmt: skip
            try:
                engine = build_engine(config)
                engine.check_overlap()
            except Exception as exc:  # the engine did not even start: that is the finding
                from minisgl.engine.selfcheck import exception_result

                out.append(_entry(group, exception_result("start-up", "engine", exc)))
                continue
            out += [_entry(group, r) for r in engine.self_check.results]
            if engine.degraded:
                for part in engine.degraded:
                    if part == "triton":
                        skip(f"{group}: cuda_graph", "the engine fell back to the torch backend")
            del engine
            if cuda:
                torch.cuda.empty_cache()
            if progress:
                progress(done + out)
    return out


def write_config(folder: Path, fields: dict) -> Path:
    """A Hugging Face config.json (a Qwen3-architecture model unless `fields` say otherwise)
    in `folder`, for an engine over random weights (--dummy-weights)."""
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "eos_token_id": 0,
        **fields,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
