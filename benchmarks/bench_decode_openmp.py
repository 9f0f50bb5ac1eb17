"""A/B in one process: CPU_MLA's shares on the package's pool vs on torch's OpenMP team.

Each round runs, interleaved, every (path, situation) pair on the same library (the OpenMP
build runs both paths): ``settled`` waits 30 ms before the timed call (torch's OpenMP threads
asleep), ``after_matmul`` runs a torch matmul (a projection-sized ``[tokens, 7168] x [7168,
1536]``) right before it, as in a serving engine where decode follows the layer's
projections, ``after_sum`` a ``sum()`` over that weight (an op torch surely runs on its
OpenMP threads: MKL may run a small fp32 matmul on one thread). Only the decode call is
timed. Prints JSON: best and median ms per pair, and
pool/openmp ratios (> 1: OpenMP faster).

    python benchmarks/bench_decode_openmp.py [--rounds 10] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import torch

from app.backends.decode.cpu_mla import decode_kernel_status, load_decode_kernel, plan_decode
from app.bench._decode_cases import RANK, Case, make_step

SITUATIONS = ("settled", "after_matmul", "after_sum")
CASES = [Case("16x8k", 16, 8192), Case("64x4k", 64, 4096),
         Case("64x4k q4", 64, 4096, query_len=4), Case("16x8k h128", 16, 8192, heads=128)]


def _cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor()


def _case(case: Case, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    kernel = load_decode_kernel()
    if kernel is None or not kernel.openmp:
        raise SystemExit(f"needs the OpenMP build: {decode_kernel_status()[1]}")
    step = make_step(case, 16, torch.device("cpu"), dtype)
    plan = plan_decode(step.seq_lens.tolist(), torch.get_num_threads())
    out = torch.empty(case.batch, case.query_len, case.heads, RANK, dtype=dtype)
    lse = torch.empty(case.batch, case.query_len, case.heads)
    x = torch.randn(case.batch * case.query_len, 7168, dtype=dtype)
    w = torch.randn(7168, 1536, dtype=dtype)

    def call(openmp: bool) -> float:
        start = time.perf_counter()
        kernel.run(plan, step.q, step.cache, step.block_table, step.seq_lens, RANK, out, lse,
                   0.1, 1.0, openmp=openmp)
        return (time.perf_counter() - start) * 1e3

    times: dict[str, list[float]] = {}
    for r in range(rounds + 1):                   # round 0: warm-up, not kept
        for situation in SITUATIONS:
            for path in ("pool", "openmp") if r % 2 else ("openmp", "pool"):
                if situation == "settled":
                    time.sleep(0.03)
                elif situation == "after_matmul":
                    torch.mm(x, w)
                else:
                    w.sum()
                ms = call(path == "openmp")
                if r:
                    times.setdefault(f"{path}/{situation}", []).append(ms)
    row: dict[str, Any] = {"case": case.name, "dtype": str(dtype).removeprefix("torch.")}
    for key, values in times.items():
        row[key] = {"best_ms": round(min(values), 3), "median_ms": round(
            statistics.median(values), 3)}
    for situation in SITUATIONS:
        pool, omp = times[f"pool/{situation}"], times[f"openmp/{situation}"]
        row[f"pool_over_openmp/{situation}"] = {
            "best": round(min(pool) / min(omp), 3),
            "median": round(statistics.median(pool) / statistics.median(omp), 3)}
    return row


def main() -> None:
    """Run the A/B and print JSON (load averages before and after each case)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    args = parser.parse_args()
    wanted = args.cases.split(",")
    rows = []
    for name in args.dtypes.split(","):
        for case in CASES:
            if case.name not in wanted:
                continue
            load_before = os.getloadavg()
            row = _case(case, getattr(torch, name), args.rounds)
            row["loadavg_before"] = [round(v, 2) for v in load_before]
            row["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"cpu": _cpu_model(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "rounds": args.rounds,
                      "library": str(decode_kernel_status()[0].path),
                      "shares": decode_kernel_status()[1], "rows": rows}))


if __name__ == "__main__":
    main()
