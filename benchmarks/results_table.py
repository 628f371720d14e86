"""Turn a gpu_check.sh output folder into a markdown results table (stdout)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str) -> int:
    out = Path(folder)
    rows = []
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
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-results"))
