# SPDX-License-Identifier: Apache-2.0
"""The runner's per-step tree bookkeeping, one launch each.

Around the target forward a DDTree step lays the trees out (every node's
parent, its depth position, the tree rows of the attention metadata) and,
after the walk, puts each accepted path first (which node's KV goes to which
slot, the token order the drafter reads hidden states in, the linear
positions back). Written as torch index operations
(:mod:`vllm_ddtree.v1.worker.verify_plan`, the CPU path and these kernels'
oracle) that is some forty small kernels a step, each a host-side launch:
on a small target the host, not the GPU, sets the step time. Here each half
is one program per request row, the row's whole tree in registers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from vllm_ddtree.v1.attention.backends.tree_attn import UniformTreeBuffers
from vllm_ddtree.v1.ops.triton_tree_cores import (
    PathFirstOrder,
    _depth_tile,
    _nodes_tile,
    _path_first_row,
    _store_ancestor_bits,
    aligned_planes,
)
from vllm_ddtree.v1.spec_decode.tree import WalkResult
from vllm_ddtree.v1.worker.host_staging import HostStaging
from vllm_ddtree.v1.worker.verify_plan import (
    StagedLayout,
    TreeRows,
    UniformTarget,
    stage_layout,
)


@triton.jit(
    do_not_specialize=[
        "stride_trees",
        "stride_par",
        "stride_tpar",
        "width",
        "num_rows",
        "stride_mask",
        "num_words",
    ]
)
def _lay_out_kernel(
    TREE_ROW,  # [R]: row of the proposal's trees, -1 for a chain
    TREE_PARENTS,  # [S, B]: parent of node j + 1 at column j (root 0)
    TREE_DEPTHS,  # [S, B]
    NUM_NODES,  # [R]: query tokens of the row, root included
    ROOT,  # [R]: batch token of the row's root
    POSITIONS,  # [tokens]: linear positions in, depth positions out
    PARENTS,  # [R (+ graph padding when FILL), width] out: root and padding -1
    TREE_INDEX,  # [R]: the row's index among the tree rows, -1 for none
    TREE_NODES,  # [T]: the tree row's nodes (a chain row's: its query)
    TREE_Q_START,  # [T]: the tree row's first token
    TREE_MASK_START,  # [T]: the tree's first row in MASK (PACK)
    SEQ_LENS,  # [R]
    T_REQ_ROWS,  # [T] int32 out (the tree rows' attention inputs)
    T_Q_START,
    T_NUM_NODES,
    T_CTX_LEN,
    T_MASK_START,
    T_PARENTS,  # [T, width] out
    MASK,  # out: ancestor masks, [rows * width, words] (FILL) or [T nodes, words]
    U_CTX,  # FILL: [rows] out, a uniform batch's context lengths
    stride_trees,
    stride_par,
    stride_tpar,
    width,
    num_rows,  # R: programs past it are graph padding (FILL only)
    stride_mask,
    num_words,
    NP: tl.constexpr,
    WP: tl.constexpr,
    FILL: tl.constexpr,
    PACK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    real = r < num_rows
    j = tl.arange(0, NP)
    # Graph padding (FILL) lays out as a chain of `width` tokens.
    n = tl.load(NUM_NODES + r, mask=real, other=width)
    row = tl.load(TREE_ROW + r, mask=real, other=-1).to(tl.int64)
    node = (j > 0) & (j < n)
    built = node & (row >= 0)
    col = tl.maximum(row, 0) * stride_trees + j - 1
    parent = tl.load(TREE_PARENTS + col, mask=built, other=0)
    depth = tl.load(TREE_DEPTHS + col, mask=built, other=0)
    t = tl.load(TREE_INDEX + r, mask=real, other=-1)
    is_tree = t >= 0
    # The tree row's nodes and first token: a chain row's are its query's
    # tokens (the row itself verifies only its last one).
    tree_n = tl.load(TREE_NODES + tl.maximum(t, 0), mask=is_tree, other=0)
    tree_n = tl.where(is_tree, tree_n, n)
    q_start = tl.load(TREE_Q_START + tl.maximum(t, 0), mask=is_tree, other=0)
    chained = (j >= n) & (j < tree_n)
    parent = tl.where(node, tl.where(row >= 0, parent, j - 1), -1)
    parent = tl.where(chained, j - 1, parent)
    depth = tl.where(row >= 0, depth, j)
    in_row = j < width
    tl.store(PARENTS + r * stride_par + j, parent, mask=in_row)
    root = tl.load(ROOT + r, mask=real, other=0)
    root_pos = tl.load(POSITIONS + root, mask=real, other=0)
    tl.store(POSITIONS + root + j, root_pos + depth, mask=node & real)
    seq_len = tl.load(SEQ_LENS + r, mask=real, other=0).to(tl.int32)
    if is_tree:
        tl.store(T_PARENTS + t * stride_tpar + j, parent, mask=in_row)
        tl.store(T_REQ_ROWS + t, r.to(tl.int32))
        tl.store(T_Q_START + t, q_start.to(tl.int32))
        tl.store(T_NUM_NODES + t, tree_n.to(tl.int32))
        tl.store(T_CTX_LEN + t, seq_len - tree_n.to(tl.int32))
    if FILL:
        tl.store(U_CTX + r, tl.maximum(seq_len - n.to(tl.int32), 0))
    if FILL or PACK:
        # Ancestor masks climbed from the parents just stored: a uniform
        # batch's every row (chains causal, graph padding too) at row
        # r * width, another batch's trees one after another.
        if FILL:
            first = r * width
        else:
            first = tl.load(
                TREE_MASK_START + tl.maximum(t, 0), mask=is_tree, other=0
            ).to(tl.int64)
            tl.store(T_MASK_START + t, first.to(tl.int32), mask=is_tree)
        tl.debug_barrier()
        _store_ancestor_bits(
            PARENTS + r * stride_par,
            tl.where(is_tree | FILL, tree_n, 0),
            MASK + first * stride_mask,
            stride_mask,
            num_words,
            width - 1,
            NP,
            WP,
        )


def lay_out_trees_triton(
    layout: StagedLayout,
    tree_shapes: tuple[torch.Tensor, torch.Tensor],
    tree_row: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    uniform: UniformTarget | None = None,
) -> tuple[torch.Tensor, TreeRows]:
    """:func:`~vllm_ddtree.v1.worker.verify_plan.lay_out_trees` in one
    launch, which also packs the trees' ancestor masks: with ``uniform`` (a
    batch of ``width``-node trees) into its graph buffers, beside their
    context lengths (the parents then cover the graph padding too); else
    one tree after another (:attr:`TreeRows.packed_mask`)."""
    num_reqs = tree_row.shape[0]
    width = layout.parents_width
    num_trees = len(layout.host_tree_rows)
    device = tree_row.device
    num_rows = num_reqs if uniform is None else uniform.num_reqs
    parents = torch.empty(num_rows, width, dtype=torch.long, device=device)
    # Read by the tree attention and the ancestor masks, one pointer each.
    rows = aligned_planes(5, (num_trees,), torch.int32, device)
    tree_parents = torch.empty(num_trees, width, dtype=torch.long, device=device)
    proposal_parents, proposal_depths = tree_shapes
    fill = uniform is not None
    assert not fill or uniform.buffers.num_nodes == width, "buffers of another size"
    pack = not fill and num_trees > 0
    if fill:
        mask = uniform.buffers.mask
    elif pack:
        words = triton.cdiv(width, 32)
        mask = torch.empty(layout.tree_total, words, dtype=torch.int32, device=device)
    else:
        # Neither FILL nor PACK: no masks written, any int32 pointer will do.
        mask = rows[0][None]
    # Without FILL the kernel writes no context lengths.
    ctx = uniform.buffers.ctx_len if fill else rows[0]
    if num_rows:
        _lay_out_kernel[(num_rows,)](
            tree_row,
            proposal_parents,
            proposal_depths,
            layout.num_nodes,
            layout.root_index,
            positions,
            parents,
            layout.tree_index,
            layout.tree_nodes,
            layout.tree_q_start,
            layout.tree_mask_start,
            seq_lens,
            *rows.unbind(0),
            tree_parents,
            mask,
            ctx,
            proposal_parents.stride(0),
            parents.stride(0),
            tree_parents.stride(0),
            width,
            num_reqs,
            mask.stride(0),
            mask.shape[1],
            NP=_nodes_tile(width),
            WP=_nodes_tile(width) // 32,
            FILL=fill,
            PACK=pack,
        )
    *attn_rows, mask_start = rows.unbind(0)
    packed = (mask, mask_start) if pack else None
    return parents, TreeRows(*attn_rows, tree_parents, packed)


@triton.jit(do_not_specialize=["stride_path", "max_depth"])
def _path_first_kernel(
    PATH,  # [R, max_depth + 1]: the walk's accepted path, -1 after it
    NUM_NODES,  # [R]
    ROOT,  # [R]
    ORDER,  # [tokens] (identity in): the token whose data goes to each, out
    POSITIONS,  # [tokens]: linear positions restored when RESTORE
    stride_path,
    max_depth,
    NP: tl.constexpr,
    DP: tl.constexpr,
    RESTORE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    steps = tl.arange(0, DP)
    path = tl.load(PATH + r * stride_path + steps, mask=steps <= max_depth, other=-1)
    _path_first_row(
        path,
        steps,
        tl.arange(0, NP),
        tl.load(NUM_NODES + r),
        tl.load(ROOT + r),
        ORDER,
        POSITIONS,
        RESTORE,
    )


def path_first_targets(
    layout: StagedLayout, num_tokens: int, positions: torch.Tensor | None = None
) -> PathFirstOrder:
    """Fresh outputs for the path-first order of ``layout``'s batch
    (``num_tokens``: at least its tokens)."""
    order = torch.arange(num_tokens, device=layout.num_nodes.device)
    return PathFirstOrder(layout.root_index, order, positions)


def path_first_order_triton(
    layout: StagedLayout,
    path: torch.Tensor,
    num_tokens: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~vllm_ddtree.v1.worker.verify_plan.path_first_order` in one
    launch (after the order's ``arange``); the V2 runner has the walk's
    launch write them instead (:func:`walk_trees_triton`'s ``path_first``)."""
    num_reqs, depth_slots = path.shape
    path_first = path_first_targets(layout, num_tokens, positions)
    if num_reqs:
        _path_first_kernel[(num_reqs,)](
            path,
            layout.num_nodes,
            *path_first.kernel_args(),
            path.stride(0),
            depth_slots - 1,
            NP=_nodes_tile(layout.width),
            DP=_depth_tile(depth_slots - 1),
            RESTORE=positions is not None,
        )
    return path_first.order


def warm_up_verify_step(
    walk: Callable[[PathFirstOrder | None], WalkResult],
    width: int,
    budget: int,
    v2_runner: bool,
    device: torch.device,
) -> None:
    """Compile the lay-out and the path-first order for one row of ``width``
    nodes on dummies with the dtypes and pointer alignments of the runner's
    calls (see ``compile_variants``; ``walk``: its dummy walk, optionally
    writing the order). The V2 runner gathers trees by request-state slot
    (int32 slots, parents and depths side by side), has the lay-out fill a
    uniform batch's graph buffers, and has the walk's
    launch write the order and put the positions back; the V1 runner's
    trees are the last build's, by batch row (int64 rows), and its order
    are a launch of their own."""
    layout = stage_layout(HostStaging(device), np.array([width]), np.array([width]))
    if v2_runner:
        shapes = torch.zeros(1, 2, budget, dtype=torch.long, device=device)
        tree_shapes = (shapes[:, 0], shapes[:, 1])
        tree_row = torch.zeros(1, dtype=torch.int32, device=device)
    else:
        shapes = aligned_planes(3, (1, budget), torch.long, device).zero_()
        tree_shapes = (shapes[1], shapes[2])
        tree_row = layout.num_nodes * 0
    positions = torch.zeros(width, dtype=torch.long, device=device)
    seq_lens = torch.full((1,), width, dtype=torch.int32, device=device)
    lay_out_trees_triton(layout, tree_shapes, tree_row, positions, seq_lens)
    if v2_runner:
        # A uniform batch's lay-out also fills its graph buffers (one row of
        # graph padding here).
        buffers = UniformTreeBuffers(2, width, width, device)
        uniform = UniformTarget(buffers, 2)
        lay_out_trees_triton(
            layout, tree_shapes, tree_row, positions, seq_lens, uniform
        )
        walk(path_first_targets(layout, width, positions))
    else:
        path_first_order_triton(layout, walk(None).path, width)
