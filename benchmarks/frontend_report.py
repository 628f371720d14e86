"""The report of the frontend benchmark (benchmarks/frontend.py): what it prints while it
measures, and the table it derives from the points it measured.

- `Progress`: one method per event of a run (a point measured, a capacity trial, a retry
  on a busy machine...), each printing one line; `Bench` in frontend.py calls them and
  prints nothing itself.
- `table_rows`: from the measured points to the table's figures (ratios, CPU per chunk),
  kept in the JSON record; `print_table` prints them.

Measured figures come in as the client's result dicts (frontend_stack.measure): chunks/s,
tokens/s, tokens per chunk, cpu % per process, others' cpu %.
"""

from __future__ import annotations


class Progress:
    """The lines printed while the benchmark runs (flushed: a run takes minutes)."""

    @staticmethod
    def say(line: str) -> None:
        print(line, flush=True)

    def layout(self, loop: str, http: str, ncpu: int, server_cpus, other_cpus, identical) -> None:
        self.say(
            f"uvicorn loop={loop} http={http}; {ncpu} CPUs; servers on "
            f"{server_cpus or 'any'}, client + tokenizer + stand-in on "
            f"{other_cpus or 'any'}; byte check {identical}"
        )

    def point(self, which: str, c: int, res: dict) -> None:
        cpu = " ".join(f"{k}={v:.0f}" for k, v in res["cpu_pct"].items())
        self.say(
            f"  c={c:<3} {which:<13} {res['chunks_per_s']:8.0f} chunks/s "
            f"{res['tokens_per_s']:8.0f} tokens/s  cpu% {cpu} others={res['others_cpu_pct']:.0f}"
        )

    def busy_machine(self, busy_pct: float) -> None:
        self.say(f"  (other processes use {busy_pct:.0f}% CPU; measuring anyway)")

    def disturbed(self, others_pct: float) -> None:
        self.say(f"  (other processes took {others_pct:.0f}% CPU meanwhile: again)")

    def trial(self, c: int, rate: float, res: dict, kept: bool) -> None:
        self.say(
            f"    capacity c={c}: offered {rate:7.0f}/s -> {res['tokens_per_s']:7.0f} tok/s "
            f"{res['tokens_per_chunk'] or 0:5.2f} tok/chunk  {'ok' if kept else 'behind'}"
        )

    def source_limited(self, c: int) -> None:
        self.say(f"    capacity c={c}: the stand-in's core is the limit")

    def fell_behind(self, c: int, tokens_per_chunk: float, rate: float) -> None:
        self.say(
            f"    capacity c={c}: {tokens_per_chunk:.2f} tok/chunk over the long "
            f"run at {rate:.0f}/s: again at {0.8 * rate:.0f}/s"
        )


# ============================================================================ the table
def us_per_chunk(res: dict, proc: str) -> float | None:
    """CPU microseconds `proc` spent per delivered chunk (cpu % is per second)."""
    return 1e4 * res["cpu_pct"][proc] / res["chunks_per_s"] if res["chunks_per_s"] else None


def table_rows(points: list[dict]) -> list[dict]:
    rows = []
    for pt in points:
        bare_res = sorted(pt["bare"], key=lambda r: r["chunks_per_s"])[len(pt["bare"]) // 2]
        burst = sorted(pt["ours_burst"], key=lambda r: r["tokens_per_s"])[
            len(pt["ours_burst"]) // 2
        ]
        paced = (pt.get("ours_paced") or {}).get("final")
        bare = bare_res["chunks_per_s"]
        row = {
            "concurrency": pt["concurrency"],
            "bare_chunks_per_s": bare,
            "bare_us_per_chunk": us_per_chunk(bare_res, "bare"),
            "ours_paced_chunks_per_s": None,
            "ours_burst_chunks_per_s": burst["chunks_per_s"],
            "ours_burst_tokens_per_s": burst["tokens_per_s"],
            "ratio_burst_chunks": burst["chunks_per_s"] / bare,
            "ratio_burst_tokens": burst["tokens_per_s"] / bare,
            "others_cpu_pct_max": max(r["others_cpu_pct"] for r in pt["bare"] + pt["ours_burst"]),
        }
        if paced:
            api_us = us_per_chunk(paced, "api")
            row.update(
                ours_paced_chunks_per_s=paced["chunks_per_s"],
                ours_paced_tokens_per_chunk=paced["tokens_per_chunk"],
                ratio_paced_chunks=paced["chunks_per_s"] / bare,
                ours_api_us_per_chunk=api_us,
                ours_tokenizer_us_per_chunk=us_per_chunk(paced, "tokenizer"),
                # what one full server core would sustain, from the CPU each spent per chunk
                ratio_per_core=row["bare_us_per_chunk"] / api_us,
                others_cpu_pct_max=max(row["others_cpu_pct_max"], paced["others_cpu_pct"]),
            )
        rows.append(row)
    return rows


def print_table(record: dict) -> None:
    print("\nchunks/s delivered to the client; CPU us per chunk of the server process")
    print(
        " streams | bare chunks/s  us/chunk | ours paced chunks/s (tok/chunk)  ratio  api us/chunk"
        "  tok us/chunk  ratio/core | ours burst chunks/s  tokens/s  ratio tokens | others CPU%"
    )
    for r in record["table"]:
        if r["ours_paced_chunks_per_s"]:
            paced = (
                f"{r['ours_paced_chunks_per_s']:19.0f} ({r['ours_paced_tokens_per_chunk']:.2f})"
                f"  {r['ratio_paced_chunks']:5.2f}  {r['ours_api_us_per_chunk']:12.1f}"
                f"  {r['ours_tokenizer_us_per_chunk']:12.1f}  {r['ratio_per_core']:10.2f}"
            )
        else:
            paced = f"{'-':>78}"
        print(
            f" {r['concurrency']:>7} | {r['bare_chunks_per_s']:13.0f}  {r['bare_us_per_chunk']:8.1f}"
            f" | {paced} | {r['ours_burst_chunks_per_s']:19.0f} "
            f"{r['ours_burst_tokens_per_s']:9.0f}  {r['ratio_burst_tokens']:12.2f} | "
            f"{r['others_cpu_pct_max']:.0f}"
        )
