# SPDX-License-Identifier: Apache-2.0
"""Host time of staging a verify batch's layout (``stage_layout``).

A layout is staged whenever a step's batch differs from the ones
``LayoutStager`` keeps: every step that admits or retires a request, which
in a served batch of 16 or 64 is most steps. This times the staging alone
(the host arrays, the pinned copy and its split) on the machine it runs on,
with and without the per-node maps that only the torch paths and the V1
runner's sampler read (the V2 runner on a GPU stages without them). On a
CPU the upload is a copy instead of an asynchronous transfer.

    python benchmarks/bench_host_staging.py --out /tmp/host_staging.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from vllm_ddtree.v1.worker.host_staging import HostStaging
from vllm_ddtree.v1.worker.verify_plan import stage_layout

# (name, node counts (1: a row without drafts), query lengths, chain_rows_upto)
CASES: list[tuple[str, np.ndarray, np.ndarray, int]] = [
    ("64 x 17 nodes", np.full(64, 17), np.full(64, 17), 0),
    ("16 x 33 nodes", np.full(16, 33), np.full(16, 33), 0),
    ("1 x 65 nodes", np.full(1, 65), np.full(1, 65), 0),
    (
        "60 x 17 nodes + 4 prompts of 64 as chain rows",
        np.r_[np.full(60, 17), np.ones(4, dtype=np.int64)],
        np.r_[np.full(60, 17), np.full(4, 64)],
        65,
    ),
]


def time_staging(
    num_nodes: np.ndarray,
    query_lens: np.ndarray,
    chain_rows_upto: int,
    node_maps: bool,
    calls: int,
    repeats: int,
) -> float:
    """Best of ``repeats`` mean times (µs) of ``calls`` stagings."""
    staging = HostStaging("cpu")
    query_end = np.cumsum(query_lens)

    def stage() -> None:
        stage_layout(staging, num_nodes, query_end, (), chain_rows_upto, node_maps)

    for _ in range(min(calls, 50)):
        stage()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            stage()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    print("| batch | with node maps (µs) | without (µs) |")
    print("|---|---:|---:|")
    for name, num_nodes, query_lens, upto in CASES:
        with_maps, without = (
            time_staging(num_nodes, query_lens, upto, maps, args.calls, args.repeats)
            for maps in (True, False)
        )
        rows.append({"batch": name, "with_maps_us": with_maps, "without_us": without})
        print(f"| {name} | {with_maps:.0f} | {without:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls": args.calls, "repeats": args.repeats, "rows": rows}, f)


if __name__ == "__main__":
    main()
