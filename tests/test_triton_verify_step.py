# SPDX-License-Identifier: Apache-2.0
"""The runner's one-launch tree lay-out, path-first moves and KV commit
equal their torch forms (CPU, Triton's interpreter).

Like ``test_triton_tree_cores.py``, the kernels run under
``TRITON_INTERPRET=1`` in one subprocess (this file with ``--worker``), which
prints one JSON line per case. Batches mix full trees, best-first prefixes,
chains (rows whose drafts were not built as trees), prefill rows and
CUDA-graph padding after the batch; the oracles are
:func:`~vllm_ddtree.v1.worker.verify_plan.lay_out_trees_torch` and
:func:`~vllm_ddtree.v1.worker.verify_plan.path_first_order_torch` (tested
against hand-made layouts in ``test_v2_runner_plan.py``) and, for the
commit, its definition. The GPU test suite runs the same comparison on the
device (``tests/gpu``).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests.utils import interpreted_case, interpreter_fixture, print_case

# name -> (budget, max depth, rows as (kind, nodes or query length), dtype of
# the rows' proposal rows, seed); kinds: "tree" (a slot's tree, cut to its
# nodes), "chain", "prefill". The V2 runner passes int32 request-state
# slots, the V1 runner int64 batch rows of the last build.
CASES: dict[str, tuple[int, int, list[tuple[str, int]], torch.dtype, int]] = {
    "one-full-tree": (8, 15, [("tree", 9)], torch.int32, 0),
    "mixed": (
        8,
        4,
        [("tree", 9), ("prefill", 5), ("tree", 4), ("chain", 6), ("tree", 1)],
        torch.int32,
        1,
    ),
    "mixed-v1-rows": (
        8,
        15,
        [("chain", 3), ("tree", 9), ("tree", 5), ("prefill", 2)],
        torch.int64,
        5,
    ),
    "budget-64": (64, 15, [("tree", 65), ("tree", 65), ("tree", 30)], torch.int32, 2),
    "budget-256": (256, 15, [("prefill", 3), ("tree", 257)], torch.int32, 4),
    # Prefill rows of up to 9 tokens are chain tree rows (CHAIN_ROWS_UPTO):
    # rows of 9 tokens and of one beside trees; a row wider than any tree
    # (the rows' parents widen).
    "chain-rows": (
        8,
        4,
        [("tree", 9), ("prefill", 9), ("tree", 4), ("prefill", 1), ("chain", 3)],
        torch.int32,
        9,
    ),
    "chain-rows-wider": (8, 4, [("tree", 6), ("prefill", 9)], torch.int32, 10),
}
# name -> the lay-out's ``chain_rows_upto`` (0 for the other cases).
CHAIN_ROWS_UPTO = {"chain-rows": 9, "chain-rows-wider": 9}
NUM_SLOTS, PADDING = 6, 3
# name -> case as above whose rows are all n-node trees (or chains), filled
# into graph buffers of n nodes with this many rows of graph padding after.
UNIFORM_CASES: dict[str, tuple[tuple, int]] = {
    "uniform-8": ((8, 4, [("tree", 9), ("chain", 9), ("tree", 9)], torch.int32, 6), 2),
    "uniform-64": ((64, 15, [("tree", 65), ("tree", 65)], torch.int32, 7), 1),
    "uniform-64-unpadded": ((64, 15, [("tree", 65)], torch.int32, 8), 0),
}


def _case(
    budget: int,
    max_depth: int,
    rows: list[tuple[str, int]],
    row_dtype: torch.dtype,
    seed: int,
    device: str,
    chain_rows_upto: int = 0,
    node_maps: bool = True,
):
    """The layout (staged with ``node_maps`` or without, see
    ``stage_layout``), trees by slot and step inputs of one case, on
    ``device``."""
    from vllm_ddtree.v1.spec_decode.tree import build_trees
    from vllm_ddtree.v1.worker.host_staging import HostStaging
    from vllm_ddtree.v1.worker.verify_plan import stage_layout

    g = torch.Generator().manual_seed(seed)
    # Peaked drafts make deep trees.
    logprobs = 5 * torch.randn(NUM_SLOTS, max_depth, budget, generator=g)
    values, order = logprobs.log_softmax(-1).sort(dim=-1, descending=True)
    trees = build_trees(values, order + 1, budget)
    num_nodes = np.array([1 if k == "prefill" else n for k, n in rows])
    query_lens = np.array([n for _, n in rows])
    slots = torch.randperm(NUM_SLOTS, generator=g)[: len(rows)]
    is_chain = torch.tensor([k == "chain" for k, _ in rows])
    tree_row = torch.where(is_chain, -1, slots).to(row_dtype)
    layout = stage_layout(
        HostStaging(device),
        num_nodes,
        np.cumsum(query_lens),
        chain_rows_upto=chain_rows_upto,
        node_maps=node_maps,
    )
    context = torch.randint(0, 50, (len(rows),), generator=g)
    positions = torch.cat(
        [c + torch.arange(q) for c, q in zip(context.tolist(), query_lens, strict=True)]
    )
    positions = torch.cat([positions, torch.zeros(PADDING, dtype=torch.long)])
    seq_lens = (context + torch.from_numpy(query_lens)).to(torch.int32)
    on_device = (tree_row, positions, seq_lens)
    return trees, layout, *(t.to(device) for t in on_device), g


def _walk(trees, tree_row, layout, parents, max_depth, g):
    """The walk (on the host) over the laid-out trees with targets that
    mostly follow a child (the root's always)."""
    from vllm_ddtree.v1.spec_decode.tree import walk_trees

    tree_row, parents = tree_row.cpu(), parents.cpu()
    num_rows, width = parents.shape
    tokens = torch.full((num_rows, width), -1, dtype=torch.long)
    for r, row in enumerate(tree_row.tolist()):
        n = int(layout.num_nodes[r])
        if n > 1:
            node_tokens = trees.tokens[max(row, 0), : n - 1]
            tokens[r, 1:n] = node_tokens if row >= 0 else 1 + torch.arange(n - 1)
    target = torch.full((num_rows, width), 9999, dtype=torch.long)
    for r in range(num_rows):
        for i in range(width):
            kids = (parents[r] == i).nonzero().flatten()
            follow = i == 0 or torch.rand(1, generator=g).item() < 0.95
            if len(kids) and follow:
                pick = kids[torch.randint(0, len(kids), (1,), generator=g)]
                target[r, i] = tokens[r, pick]
    return walk_trees(tokens, parents, layout.num_nodes.cpu(), target, max_depth)


def compare(name: str, device: str = "cpu") -> dict:
    """The kernels' results next to the torch forms' for case ``name``. The
    kernels read the layout as the V2 runner stages it on a GPU, without the
    node maps that the torch forms read."""
    from vllm_ddtree.v1.ops.triton_verify_step import (
        lay_out_trees_triton,
        path_first_order_triton,
    )
    from vllm_ddtree.v1.worker.verify_plan import (
        lay_out_trees_torch,
        path_first_order_torch,
        tree_attention_info,
    )

    budget, max_depth, *_ = CASES[name]
    upto = CHAIN_ROWS_UPTO.get(name, 0)
    trees, layout, tree_row, positions, seq_lens, g = _case(*CASES[name], device, upto)
    lean = _case(*CASES[name], device, upto, node_maps=False)[1]
    shapes = (trees.parents.to(device), trees.depths.to(device))
    ref_positions = positions.clone()
    ref_parents, ref_rows = lay_out_trees_torch(
        layout, shapes, tree_row, ref_positions, seq_lens
    )
    got_positions = positions.clone()
    got_parents, got_rows = lay_out_trees_triton(
        lean, shapes, tree_row, got_positions, seq_lens
    )
    fields = ("req_rows", "q_start", "num_nodes", "ctx_len", "parents")
    # The masks packed by the lay-out against the tree metadata's own
    # packing of the torch rows (every ancestor: chain rows run deeper than
    # the trees' max_depth).
    seq_len_bound = seq_lens.cpu().numpy().astype(np.int64)
    ref_tree = tree_attention_info(layout, ref_rows, seq_len_bound, layout.width - 1)
    ref_mask, ref_mask_start = ref_tree.packed_mask
    got_mask, got_mask_start = got_rows.packed_mask
    res = {
        "mask_equal": torch.equal(got_mask.cpu(), ref_mask.cpu())
        and torch.equal(got_mask_start.cpu(), ref_mask_start.cpu()),
        "mask_aligned": got_mask_start.data_ptr() % 16 == 0,
        "parents_equal": torch.equal(got_parents, ref_parents),
        "positions_equal": torch.equal(got_positions, ref_positions),
        "depth_moved": not torch.equal(ref_positions, positions),
        # Each int32 field on its own 16-byte boundary (Triton specialises
        # the attention and mask kernels on it; 3 tree rows pack to 12 bytes).
        "rows_aligned": all(
            getattr(got_rows, f).data_ptr() % 16 == 0
            for f in ("req_rows", "q_start", "num_nodes", "ctx_len")
        ),
        "rows_equal": {
            f: torch.equal(getattr(got_rows, f), getattr(ref_rows, f)) for f in fields
        },
        "chain_rows": _chain_rows_check(layout, ref_tree, CASES[name][2]),
        "lean_layout": _same_but_node_maps(lean, layout),
    }
    walk = _walk(trees, tree_row, layout, ref_parents[:, : layout.width], max_depth, g)
    path = walk.path.to(device)
    num_tokens = positions.shape[0]
    ref = path_first_order_torch(layout, path, num_tokens, ref_positions)
    got = path_first_order_triton(lean, path, num_tokens, got_positions)
    res.update(
        _commit_results(layout, path, num_tokens, g),
        order_equal=torch.equal(got, ref),
        restored=torch.equal(got_positions, positions)
        and torch.equal(ref_positions, positions),
        max_accepted=int(walk.num_accepted.max()),
    )
    return res


def _same_but_node_maps(lean, layout) -> bool:
    """``lean`` (staged without node maps) is ``layout`` less those: the
    same arrays elsewhere, the node maps and the sampler's rows ``None``."""
    from dataclasses import fields

    maps = ("node_tokens", "node_rows", "node_ids", "rows")
    ok = all(getattr(lean, f) is None for f in maps)
    ok &= layout.rows.logit_rows is layout.logit_rows
    for field in fields(layout):
        if field.name in maps:
            continue
        want, got = getattr(layout, field.name), getattr(lean, field.name)
        if field.name == "extra":
            ok &= len(got) == len(want) and all(map(torch.equal, got, want))
        elif isinstance(want, torch.Tensor):
            ok &= torch.equal(got, want)
        elif isinstance(want, np.ndarray):
            ok &= np.array_equal(got, want)
        else:
            ok &= got == want
    return bool(ok)


def _chain_rows_check(layout, tree, rows: list[tuple[str, int]]) -> bool | None:
    """For a layout with chain rows (else ``None``): every row of the case
    (``rows``) is a tree row, and each prefill row's is its whole query,
    from its first token, with causal attention over it."""
    if not layout.chain_rows:
        return None
    query_lens = [n for _, n in rows]
    ok = tree.covers_batch and tree.req_rows_cpu == list(range(len(rows)))
    for r, (kind, q) in enumerate(rows):
        if kind != "prefill":
            continue
        causal = torch.ones(q, q, dtype=torch.bool).tril()
        ok &= tree.num_nodes_cpu[r] == q
        ok &= tree.q_start_cpu[r] == sum(query_lens[:r])
        ok &= torch.equal(tree.mask[r, :q, :q].cpu(), causal)
    return bool(ok)


def committed_rows(
    layers: list[torch.Tensor],
    slots: torch.Tensor,
    roots: torch.Tensor,
    path: torch.Tensor,
) -> list[torch.Tensor]:
    """The KV commit's definition, on copies of ``layers`` (``[slots,
    width]`` rows, on the CPU): the accepted node at depth ``d`` of request
    ``r`` lands in the slot of batch token ``roots[r] + d`` (``slots``: each
    batch token's), and no other slot changes."""
    expected = [rows.clone() for rows in layers]
    roots = roots.cpu().tolist()
    for r, row in enumerate(path.cpu().tolist()):
        for d, node in enumerate(row[1:], start=1):
            if node < 0:
                break
            for want, rows in zip(expected, layers, strict=True):
                want[slots[roots[r] + d]] = rows[slots[roots[r] + node]]
    return expected


def random_kv_layers(
    num_tokens: int, g: torch.Generator
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Batch tokens on shuffled slots (a few spare) and two layers of slot
    rows 24 wide (not a power of two)."""
    num_slots = num_tokens + 7
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    return slots, [torch.randn(num_slots, 24, generator=g) for _ in range(2)]


def _commit_results(layout, path, num_tokens: int, g) -> dict:
    """The all-layers KV commit kernel and the layer-by-layer torch moves
    (:func:`~vllm_ddtree.v1.worker.verify_plan.path_moves`), each against
    the commit's definition (:func:`committed_rows`)."""
    from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit
    from vllm_ddtree.v1.worker.verify_plan import path_moves

    device = path.device
    slots, layers = random_kv_layers(num_tokens, g)
    expected = committed_rows(layers, slots, layout.root_index, path)
    kernel_rows = [rows.clone().to(device) for rows in layers]
    commit = SlotRowsCommit.for_rows(kernel_rows)
    commit(slots.to(device), layout.root_index, path)
    torch_rows = [rows.clone() for rows in layers]
    src, dst = path_moves(layout.root_index.cpu(), path.cpu())
    for rows in torch_rows:
        rows[slots[dst]] = rows[slots[src]]
    return {
        "commit_kernel_equal": all(
            torch.equal(got.cpu(), want)
            for got, want in zip(kernel_rows, expected, strict=True)
        ),
        "commit_torch_equal": all(
            torch.equal(got, want)
            for got, want in zip(torch_rows, expected, strict=True)
        ),
        "commit_moved": not torch.equal(expected[0], layers[0]),
    }


def compare_uniform(name: str, device: str = "cpu") -> dict:
    """The lay-out kernel filling a uniform batch's graph buffers, against
    the same buffers filled by the tree metadata builder
    (:meth:`UniformTreeBuffers.fill` of the torch lay-out's published tree,
    the steps without a fill from the lay-out)."""
    from vllm_ddtree.v1.attention.backends.tree_attn import (
        UniformFill,
        UniformTreeBuffers,
    )
    from vllm_ddtree.v1.ops.triton_verify_step import lay_out_trees_triton
    from vllm_ddtree.v1.worker.verify_plan import (
        UniformTarget,
        lay_out_trees_torch,
        tree_attention_info,
    )

    case, padding = UNIFORM_CASES[name]
    trees, layout, tree_row, positions, seq_lens, _ = _case(*case, device)
    # The kernel reads the layout as the V2 runner stages it on a GPU.
    lean = _case(*case, device, node_maps=False)[1]
    num_reqs, n = tree_row.shape[0], layout.width
    num_rows = num_reqs + padding
    shapes = (trees.parents.to(device), trees.depths.to(device))

    def buffers() -> UniformTreeBuffers:
        return UniformTreeBuffers(num_rows + 1, n, 512, torch.device(device))

    ref_buffers, got_buffers = buffers(), buffers()
    # Stale inputs of an earlier step that the fill must overwrite.
    for b in (ref_buffers, got_buffers):
        b.mask.fill_(-1)
        b.ctx_len.fill_(77)
    ref_parents, ref_rows = lay_out_trees_torch(
        layout, shapes, tree_row, positions.clone(), seq_lens
    )
    seq_len_bound = seq_lens.cpu().numpy().astype(np.int64)
    tree = tree_attention_info(layout, ref_rows, seq_len_bound, n - 1)
    padded_seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(padding)])
    ref = ref_buffers.fill(num_rows, padded_seq_lens, tree)
    # fill's steady-state path leaves the padding rows' masks alone.
    ref_buffers.mask[num_reqs * n : num_rows * n] = ref_buffers.chain_mask[
        num_reqs * n : num_rows * n
    ]
    got_positions = positions.clone()
    got_parents, _ = lay_out_trees_triton(
        lean,
        shapes,
        tree_row,
        got_positions,
        seq_lens,
        UniformTarget(got_buffers, num_rows),
    )
    tree.uniform_fill = UniformFill(got_buffers, num_rows, got_parents)
    untouched = got_buffers.mask.clone()
    got = got_buffers.fill(num_rows, padded_seq_lens, tree)
    rows = slice(0, num_rows * n)
    return {
        "mask_equal": torch.equal(
            got_buffers.mask[rows], ref_buffers.mask[rows].to(device)
        ),
        "ctx_equal": torch.equal(
            got_buffers.ctx_len[:num_rows], ref_buffers.ctx_len[:num_rows]
        ),
        "parents_equal": torch.equal(got_parents[:num_reqs], ref_parents)
        and torch.equal(
            got_parents[num_reqs:], ref_buffers.chain_parents[num_reqs:num_rows]
        ),
        "fill_skipped": torch.equal(got_buffers.mask, untouched)
        and got.parents is got_parents,
        "same_description": all(
            torch.equal(getattr(got, f), getattr(ref, f))
            for f in ("req_rows", "q_start", "num_nodes", "ctx_len")
        )
        and got.packed[0].data_ptr() == got_buffers.mask.data_ptr(),
        "mask_has_trees": not torch.equal(
            got_buffers.mask[rows], got_buffers.chain_mask[rows]
        ),
    }


def _worker() -> None:
    cases = [(name, compare) for name in CASES]
    cases += [(name, compare_uniform) for name in UNIFORM_CASES]
    for name, run in cases:
        try:
            res = run(name)
        except Exception as exc:
            res = {"error": repr(exc)}
        print_case(name, res)


interp_results = interpreter_fixture(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_verify_step_kernels_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert rec["parents_equal"] and rec["positions_equal"], rec
    assert all(rec["rows_equal"].values()) and rec["rows_aligned"], rec
    assert rec["mask_equal"] and rec["mask_aligned"], rec
    assert rec["order_equal"] and rec["restored"], rec
    assert rec["commit_kernel_equal"] and rec["commit_torch_equal"], rec
    # The cases move nodes: deep trees and walks that accept several nodes.
    assert rec["depth_moved"] and rec["max_accepted"] >= 2, rec
    # Prefill rows became chain rows exactly where the case allows them.
    assert rec["chain_rows"] is (True if name in CHAIN_ROWS_UPTO else None), rec
    assert rec["lean_layout"], rec


@pytest.mark.parametrize("name", list(UNIFORM_CASES))
def test_lay_out_fills_uniform_buffers_interpreted(interp_results, name):
    """A uniform batch's graph buffers filled by the lay-out launch hold what
    the builder's fill would have written (trees, chain rows and chain
    graph padding), and the builder's fill then launches nothing."""
    rec = interpreted_case(interp_results, name)
    assert rec["mask_equal"] and rec["ctx_equal"] and rec["parents_equal"], rec
    assert rec["fill_skipped"] and rec["same_description"], rec
    assert rec["mask_has_trees"], rec


def test_commit_cases_move_kv(interp_results):
    # Walks along the spine leave the KV in place (nothing to move); the
    # wide trees' walks take side branches.
    moved = [interpreted_case(interp_results, n)["commit_moved"] for n in CASES]
    assert sum(moved) >= 2, moved


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
