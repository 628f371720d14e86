"""Turn a gpu_check.sh output folder into a markdown results table (stdout); with
`--doctor`, only the doctor's verdict (every failed check named) and its probe."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def doctor_rows(out: Path) -> list[str]:
    """The doctor's checks (passed of all, each failure named) and its throughput probe."""
    path = out / "doctor.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # it crashed or timed out: say so, not nothing
        return [f"| doctor | no result ({type(exc).__name__}): see doctor.log | |"]
    checks = doc["checks"]
    failed = [c for c in checks if not c["passed"]]
    verdict = "all passed" if not failed else f"{len(failed)} FAILED"
    rows = [f"| doctor | {len(checks) - len(failed)}/{len(checks)} checks passed | {verdict} |"]
    for c in failed:
        error = f"max error {c['max_error']:.3g}" if c["max_error"] is not None else "raised"
        rows.append(f"| doctor FAILED | {c['name']}: {error} | {c['detail'][:160]} |")
    if t := doc.get("throughput"):
        what = f"{t['model']}, {t['dtype']}, {t['attention_backend']}"
        p, d = t["prefill"], t["decode"]
        rows.append(f"| doctor probe, prefill {p['batch']} x {p['prompt_tokens']} | {what} "
                    f"| {p['tokens_per_s']:.0f} tok/s |")  # fmt: skip
        rows.append(f"| doctor probe, decode {d['batch']} sequences | {d['ms_per_step']:.2f} "
                    f"ms/step | {d['tokens_per_s']:.0f} tok/s |")  # fmt: skip
    return rows


def main(folder: str, doctor_only: bool = False) -> int:
    out = Path(folder)
    rows = doctor_rows(out) if doctor_only or (out / "doctor.json").exists() else []
    if doctor_only:
        print("\n".join(rows))
        return 0
    gpu = (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").exists() else "?"
    if (out / "offline.json").exists():
        data = json.loads((out / "offline.json").read_text())
        for r in data.get("results", []):
            rows.append(
                f"| offline, {r['engine']} | {r['output_tokens']} tokens in {r['seconds']:.1f} s "
                f"| {r['output_tokens'] / r['seconds']:.0f} output tok/s |"
            )
        results = data.get("results", [])
        if len(results) == 2 and all(r["seconds"] > 0 for r in results):
            ours, theirs = (r["output_tokens"] / r["seconds"] for r in results)
            rows.append(f"| offline, minisgl / {results[1]['engine']} | | {ours / theirs:.1f}x |")
    if (out / "decode_latency.json").exists():
        d = json.loads((out / "decode_latency.json").read_text())
        rows.append(
            f"| batch-1 decode, prompt {d['prompt_len']} | first token {d['ttft_ms']:.1f} ms "
            f"| {d['ms_per_token']:.3f} ms/token |"
        )
    if (out / "prefix_cache.json").exists():
        d = json.loads((out / "prefix_cache.json").read_text())
        ttft = d["mean_ttft_s"]
        rows.append(
            f"| prefix cache, {d['args']['num_seqs']} requests sharing "
            f"{d['args']['system_len']} tokens | mean TTFT {ttft['none']:.3f} s off, "
            f"{ttft['radix']:.3f} s on | {d['ttft_ratio']:.1f}x |"
        )
    print(f"Machine: {gpu}\n")
    print("| measurement | detail | figure |\n| --- | --- | --- |")
    print("\n".join(rows) if rows else "| (no results) | | |")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    doctor_only = "--doctor" in args
    folders = [a for a in args if a != "--doctor"]
    sys.exit(main(folders[0] if folders else "gpu-results", doctor_only))
