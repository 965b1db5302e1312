# SPDX-License-Identifier: Apache-2.0
"""Per-step tree cores on a GPU: torch (a launch per op and depth) vs. the
one-launch Triton kernels.

For each batch size ``R`` and budget ``B`` (drafter depth 15, top-``B``
log-probabilities per depth): the tree build, the walk (Triton: with vLLM's
sampler rows) and the packed ancestor masks. Times are wall-clock per call
with the GPU synchronised around a loop of calls, i.e. launch cost included,
which is what a step pays when the host waits for the GPU; and, for the
Triton kernels, device time per call (``*_gpu_ms``: a CUDA graph of 50 calls
replayed), which is what it pays when the launch overlaps the GPU's work
(async scheduling). The issue's target for the build is 50 us at ``R=64,
B=64``.

    python benchmarks/bench_tree_cores.py --out docs/benchmarks/tree_cores.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEPTHS = 15


def _time_ms(fn: Callable[[], object], iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def _graph_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """Device time per call: ``iters`` calls captured in one CUDA graph and
    replayed, so no host launch cost is counted (NaN if capture fails)."""
    try:
        return _replay_ms(fn, iters)
    except RuntimeError as exc:
        print(f"CUDA-graph timing failed: {exc!r}"[:300], flush=True)
        return math.nan


def _replay_ms(fn: Callable[[], object], iters: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up off the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _inputs(num_reqs: int, budget: int):
    """Drafter top-B log-probabilities, the trees built from them, and target
    tokens that follow each tree's best-first spine (walks go deep)."""
    from vllm_ddtree.v1.spec_decode.tree import build_trees

    logits = torch.randn(num_reqs, DEPTHS, 4 * budget, device="cuda") * 3
    values, tokens = logits.log_softmax(-1).topk(budget, dim=-1)
    trees = build_trees(values, tokens, budget)
    root = torch.full((num_reqs, 1), -1, dtype=torch.long, device="cuda")
    parents = torch.cat([root, trees.parents], dim=1)
    node_tokens = torch.cat([root, trees.tokens], dim=1)
    num_nodes = torch.full((num_reqs,), budget + 1, device="cuda")
    target = torch.roll(node_tokens, -1, dims=1)
    return values, tokens, parents, node_tokens, num_nodes, target


def time_case(num_reqs: int, budget: int, build_warps: list[int]) -> dict:
    """Torch and Triton times of the three cores at one ``(R, B)``, and the
    build's device time with each of ``build_warps`` warps a program."""
    from vllm_ddtree.v1.attention.backends.tree_attn import pack_ancestor_mask
    from vllm_ddtree.v1.ops.triton_tree_cores import (
        build_trees_triton,
        packed_ancestor_mask_triton,
        walk_trees_triton,
    )
    from vllm_ddtree.v1.spec_decode.tree import ancestor_mask, build_trees, walk_trees

    values, tokens, parents, node_tokens, num_nodes, target = _inputs(num_reqs, budget)
    counts = [budget + 1] * num_reqs
    _, starts = pack_ancestor_mask(ancestor_mask(parents, num_nodes, DEPTHS), counts)
    out = torch.full((num_reqs, budget + 1), -1, dtype=torch.int32, device="cuda")
    walk_args = (node_tokens, parents, num_nodes, target, DEPTHS)
    triton = {
        "build": lambda: build_trees_triton(values, tokens, budget),
        "walk": lambda: walk_trees_triton(*walk_args, out),
        "mask": lambda: packed_ancestor_mask_triton(
            parents, num_nodes, starts, sum(counts), DEPTHS
        ),
    }
    row = {
        "batch": num_reqs,
        "budget": budget,
        "build_torch_ms": _time_ms(lambda: build_trees(values, tokens, budget)),
        "build_triton_ms": _time_ms(triton["build"]),
        "walk_torch_ms": _time_ms(lambda: walk_trees(*walk_args)),
        "walk_triton_ms": _time_ms(triton["walk"]),
        "mask_torch_ms": _time_ms(
            lambda: pack_ancestor_mask(
                ancestor_mask(parents, num_nodes, DEPTHS), counts
            )
        ),
        "mask_triton_ms": _time_ms(triton["mask"]),
    } | {f"{name}_triton_gpu_ms": _graph_ms(fn) for name, fn in triton.items()}
    for w in build_warps:
        row[f"build_triton_gpu_ms_warps{w}"] = _graph_ms(
            lambda w=w: build_trees_triton(values, tokens, budget, num_warps=w)
        )
    return row


def run(
    batch_sizes: list[int], budgets: list[int], build_warps: list[int]
) -> list[dict]:
    rows = []
    for budget in budgets:
        for num_reqs in batch_sizes:
            row = time_case(num_reqs, budget, build_warps)
            rows.append(row)
            print(
                f"R={num_reqs:3d} B={budget:3d}  "
                + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if "_ms" in k),
                flush=True,
            )
    return rows


def table(rows: list[dict]) -> str:
    columns = {
        "build torch": "build_torch_ms",
        "build Triton": "build_triton_ms",
        "build Triton (device)": "build_triton_gpu_ms",
        "walk torch": "walk_torch_ms",
        "walk Triton": "walk_triton_ms",
        "walk Triton (device)": "walk_triton_gpu_ms",
        "mask torch": "mask_torch_ms",
        "mask Triton": "mask_triton_ms",
        "mask Triton (device)": "mask_triton_gpu_ms",
    }
    lines = [
        "| R | B | " + " | ".join(columns) + " |",
        "|---:|---:|" + "---:|" * len(columns),
    ]
    for r in rows:
        cells = [f"{r[k]:.3f}" for k in columns.values()]
        lines.append(f"| {r['batch']} | {r['budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument(
        "--build-warps",
        default="",
        help="comma-separated warp counts: also time the build with each",
    )
    ap.add_argument("--out", type=Path, default=Path("tree_cores.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tree_cores.py needs a CUDA GPU")
    rows = run(
        [int(x) for x in args.batch_sizes.split(",")],
        [int(x) for x in args.budgets.split(",")],
        [int(x) for x in args.build_warps.split(",") if x],
    )
    md = table(rows)
    print(md)
    args.out.write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2)
    )
    args.out.with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
