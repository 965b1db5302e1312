"""Gated DeltaNet cost of one verify step: tree (DDTree) vs chain (DFlash).

Shape: a Qwen3.5-9B-like hybrid (24 GDN layers; 16 key / 32 value heads of
128; conv width 4; fp32 state cache, bf16 activations), dummy data. Per
batch size and budget ``B``, over all GDN layers of one verify step:

* ``tree_ms``: the plugin's Triton tree conv + tree recurrence over random
  ``B + 1``-node trees;
* ``tree_as_chain_ms``: the same kernels on a chain of ``B + 1`` nodes
  (register-resident path, the best case);
* ``chain16_ms``: vLLM's own ``causal_conv1d_update`` +
  ``fused_sigmoid_gating_delta_rule_update`` over a 16-token chain (stock
  DFlash's verify, 15 drafts), the number DDTree is traded against;
* ``commit_fused_ms`` / ``commit_torch_ms``: the accepted-path commit of
  all layers, by the two-launch Triton commit and by the per-layer torch
  reference (what the runner did before the fused commit).

Kernel rows are CUDA-graph replays of one layer (device time, no launch
overhead) times the layer count; ``*_eager_ms`` are the same launched from
Python (host-bound at small batch). The commits are timed eagerly, as the
runner calls them; the fused one addresses one layer's caches 24 times
(the tree batches do not fit 24 times in memory at batch 32, B=128), so
its sources may partly hit L2.

Projections, MoE/MLP and full attention are not included (they are shared
with the dense path and measured in docs/benchmarks/tree_attention.md).

Usage (GPU)::

    python benchmarks/bench_hybrid_verify.py --out /tmp/hybrid_verify.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_tree_gdn_ops import leaf_paths, make_gdn_batch  # noqa: E402
from vllm_ddtree.v1.ops import triton_tree_gdn  # noqa: E402
from vllm_ddtree.v1.ops.tree_gdn import commit_tree_state  # noqa: E402
from vllm_ddtree.v1.ops.triton_gdn_commit import GDNStateCommit  # noqa: E402

NUM_GDN_LAYERS = 24
HEADS, HEAD_DIMS, WIDTH = (16, 32), (128, 128), 4
DIM = 2 * HEADS[0] * HEAD_DIMS[0] + HEADS[1] * HEAD_DIMS[1]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _bench_graph(fn) -> float:
    """Median ms of a CUDA-graph replay of ``fn`` (compiled and warmed up
    eagerly first: Triton's autotuning cannot run under capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay)


def _batch(batch: int, nodes: int, kind: str):
    b = make_gdn_batch(
        [nodes] * batch,
        dim=DIM,
        width=WIDTH,
        heads=HEADS,
        head_dims=HEAD_DIMS,
        dtype=torch.bfloat16,
        device="cuda",
        kinds=(kind,),
        spare_slots=1,
    )
    b.ssm_state = b.ssm_state.float()
    return b


def _tree_layer(b):
    def run():
        triton_tree_gdn.tree_causal_conv1d_update(
            b.x, b.conv_state, b.conv_weight, b.conv_bias, "silu",
            b.conv_slots, b.query_start_loc, b.flat_parents,
        )  # fmt: skip
        triton_tree_gdn.tree_gated_delta_rule(
            b.q, b.k, b.v, b.a, b.b, b.A_log, b.dt_bias, b.ssm_state,
            b.state_indices, b.query_start_loc, b.flat_parents,
        )  # fmt: skip

    return run


def _commits(b, budget: int):
    """The fused all-layers commit and the per-layer torch commit of one
    accepted path per request (the first ``min(B, 8) + 1`` nodes of a
    root-to-leaf path, in the engine's slot layout)."""
    batch = len(b.sizes)
    path = torch.zeros(batch, budget + 1, dtype=torch.long)
    for r, parents in enumerate(b.parents):
        longest = max(leaf_paths(parents), key=len)[: min(budget, 8) + 1]
        path[r, : len(longest)] = torch.tensor(longest)
    path_len = (path != 0).sum(1) + 1
    path, path_len = path.cuda(), path_len.cuda()
    slots = b.state_indices
    fused = GDNStateCommit(
        [b.conv_state] * NUM_GDN_LAYERS, [b.ssm_state] * NUM_GDN_LAYERS
    )

    def torch_commit():
        for _ in range(NUM_GDN_LAYERS):
            commit_tree_state(
                b.conv_state, b.ssm_state, slots[:, 0], slots, path, path_len, WIDTH
            )

    return lambda: fused(slots, path, path_len, WIDTH), torch_commit


def _chain_step(b):
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update
    from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
        fused_sigmoid_gating_delta_rule_update,
    )

    ones = torch.ones(len(b.sizes), dtype=torch.int32, device="cuda")
    n = b.sizes[0]

    def run():
        causal_conv1d_update(
            b.x, b.conv_state, b.conv_weight, b.conv_bias, "silu",
            conv_state_indices=b.conv_slots, num_accepted_tokens=ones,
            query_start_loc=b.query_start_loc, max_query_len=n, validate_data=False,
        )  # fmt: skip
        fused_sigmoid_gating_delta_rule_update(
            A_log=b.A_log, a=b.a, b=b.b, dt_bias=b.dt_bias,
            q=b.q[None], k=b.k[None], v=b.v[None], initial_state=b.ssm_state,
            inplace_final_state=True, cu_seqlens=b.query_start_loc,
            ssm_state_indices=b.state_indices[:, :n], num_accepted_tokens=ones,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32])
    ap.add_argument("--budgets", type=_ints, default=[16, 32, 64, 128])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    layers = NUM_GDN_LAYERS
    for batch in args.batches:
        chain = _chain_step(_batch(batch, 16, "chain"))
        chain_ms = {
            "chain16_ms": _bench_graph(chain) * layers,
            "chain16_eager_ms": _bench(chain) * layers,
        }
        for budget in args.budgets:
            res = {"batch": batch, "B": budget, **chain_ms}
            for kind, key in (("chain", "tree_as_chain"), ("random", "tree")):
                b = _batch(batch, budget + 1, kind)
                res[f"{key}_ms"] = _bench_graph(_tree_layer(b)) * layers
                res[f"{key}_eager_ms"] = _bench(_tree_layer(b)) * layers
            fused, per_layer = _commits(b, budget)  # the random trees
            res["commit_fused_ms"] = _bench(fused)
            res["commit_torch_ms"] = _bench(per_layer)
            rows.append(res)
            print(
                f"batch {batch:3d} B {budget:4d} (x{layers} GDN layers, graphs): "
                f"tree {res['tree_ms']:.3f} ms, tree-as-chain "
                f"{res['tree_as_chain_ms']:.3f} ms, stock chain(16) "
                f"{res['chain16_ms']:.3f} ms; eager: tree {res['tree_eager_ms']:.3f}"
                f", chain {res['chain16_eager_ms']:.3f}; commit: fused "
                f"{res['commit_fused_ms']:.3f} ms, torch {res['commit_torch_ms']:.3f}",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
