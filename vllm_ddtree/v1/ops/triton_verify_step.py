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

import torch
import triton
import triton.language as tl

from vllm_ddtree.v1.ops.triton_tree_cores import _depth_tile, _nodes_tile


@triton.jit(do_not_specialize=["stride_trees", "stride_par", "stride_tpar", "width"])
def _lay_out_kernel(
    TREE_ROW,  # [R]: row of the proposal's trees, -1 for a chain
    TREE_PARENTS,  # [S, B]: parent of node j + 1 at column j (root 0)
    TREE_DEPTHS,  # [S, B]
    NUM_NODES,  # [R]: query tokens of the row, root included
    ROOT,  # [R]: batch token of the row's root
    POSITIONS,  # [tokens]: linear positions in, depth positions out
    PARENTS,  # [R, width] out: root and padding -1
    TREE_INDEX,  # [R]: the row's index among the tree rows, -1 for none
    SEQ_LENS,  # [R]
    T_REQ_ROWS,  # [T] int32 out (the tree rows' attention inputs)
    T_Q_START,
    T_NUM_NODES,
    T_CTX_LEN,
    T_PARENTS,  # [T, width] out
    stride_trees,
    stride_par,
    stride_tpar,
    width,
    NP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    n = tl.load(NUM_NODES + r)
    row = tl.load(TREE_ROW + r).to(tl.int64)
    node = (j > 0) & (j < n)
    built = node & (row >= 0)
    col = tl.maximum(row, 0) * stride_trees + j - 1
    parent = tl.load(TREE_PARENTS + col, mask=built, other=0)
    depth = tl.load(TREE_DEPTHS + col, mask=built, other=0)
    parent = tl.where(node, tl.where(row >= 0, parent, j - 1), -1)
    depth = tl.where(row >= 0, depth, j)
    in_row = j < width
    tl.store(PARENTS + r * stride_par + j, parent, mask=in_row)
    root = tl.load(ROOT + r)
    root_pos = tl.load(POSITIONS + root)
    tl.store(POSITIONS + root + j, root_pos + depth, mask=node)
    t = tl.load(TREE_INDEX + r)
    if t >= 0:
        tl.store(T_PARENTS + t * stride_tpar + j, parent, mask=in_row)
        tl.store(T_REQ_ROWS + t, r.to(tl.int32))
        tl.store(T_Q_START + t, root.to(tl.int32))
        tl.store(T_NUM_NODES + t, n.to(tl.int32))
        ctx = tl.load(SEQ_LENS + r).to(tl.int32) - n.to(tl.int32)
        tl.store(T_CTX_LEN + t, ctx)


def lay_out_trees_triton(
    tree_row: torch.Tensor,
    tree_parents: torch.Tensor,
    tree_depths: torch.Tensor,
    num_nodes: torch.Tensor,
    root_index: torch.Tensor,
    positions: torch.Tensor,
    tree_index: torch.Tensor,
    seq_lens: torch.Tensor,
    num_trees: int,
    width: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One launch of :func:`~vllm_ddtree.v1.worker.verify_plan.lay_out_trees`'s
    work (see there for the arguments): returns ``parents [R, width]`` and
    the tree rows' ``(req_rows, q_start, num_nodes, ctx_len)`` (int32) and
    ``parents [num_trees, width]``; ``positions`` is rewritten in place."""
    num_reqs = tree_row.shape[0]
    device = tree_row.device
    parents = torch.empty(num_reqs, width, dtype=torch.long, device=device)
    # Each int32 row on a 16-byte boundary, as a fresh allocation would be:
    # Triton specialises the kernels that read them (the tree attention, the
    # ancestor masks) on their pointers' alignment.
    rows = torch.empty(4, -(-num_trees // 4) * 4, dtype=torch.int32, device=device)
    rows = rows[:, :num_trees]
    tree_parents_out = torch.empty(num_trees, width, dtype=torch.long, device=device)
    if num_reqs:
        _lay_out_kernel[(num_reqs,)](
            tree_row,
            tree_parents,
            tree_depths,
            num_nodes,
            root_index,
            positions,
            parents,
            tree_index,
            seq_lens,
            rows[0],
            rows[1],
            rows[2],
            rows[3],
            tree_parents_out,
            tree_parents.stride(0),
            parents.stride(0),
            tree_parents_out.stride(0),
            width,
            NP=_nodes_tile(width),
        )
    return parents, (*rows.unbind(0), tree_parents_out)


@triton.jit(do_not_specialize=["stride_path", "max_depth"])
def _path_first_kernel(
    PATH,  # [R, max_depth + 1]: the walk's accepted path, -1 after it
    NUM_NODES,  # [R]
    ROOT,  # [R]
    DRAFT_START,  # [R]: index of the row's first non-root node among all
    SRC,  # [num_drafts] out: batch token whose data moves ...
    DST,  # [num_drafts] out: ... to this batch token
    ORDER,  # [tokens] (identity in): ORDER[dst] = src out
    POSITIONS,  # [tokens]: linear positions restored when RESTORE
    stride_path,
    max_depth,
    NP: tl.constexpr,
    DP: tl.constexpr,
    RESTORE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    steps = tl.arange(0, DP)
    n = tl.load(NUM_NODES + r)
    root = tl.load(ROOT + r)
    path = tl.load(PATH + r * stride_path + steps, mask=steps <= max_depth, other=-1)
    on_step = (path[:, None] == j[None, :]) & (path[:, None] >= 0)
    on_path = tl.sum(on_step.to(tl.int32), axis=0) > 0
    path_slot = tl.sum(tl.where(on_step, steps[:, None], 0), axis=0)
    path_len = tl.sum((path >= 0).to(tl.int32), axis=0)
    # Off-path nodes follow the path in node order.
    off_path = (j < n) & ~on_path
    rank = tl.cumsum(off_path.to(tl.int32), axis=0) - 1
    slot = tl.where(on_path, path_slot, path_len + rank).to(tl.int64)
    node = (j > 0) & (j < n)
    k = tl.load(DRAFT_START + r) + j - 1
    tl.store(SRC + k, root + j, mask=node)
    tl.store(DST + k, root + slot, mask=node)
    tl.store(ORDER + root + slot, root + j, mask=node)
    if RESTORE:
        root_pos = tl.load(POSITIONS + root)
        tl.store(POSITIONS + root + j, root_pos + j, mask=node)


def path_first_moves_triton(
    path: torch.Tensor,
    num_nodes: torch.Tensor,
    root_index: torch.Tensor,
    draft_start: torch.Tensor,
    num_drafts: int,
    width: int,
    order: torch.Tensor,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of
    :func:`~vllm_ddtree.v1.worker.verify_plan.path_first_moves`'s work:
    returns ``(src, dst)``, writes ``order`` (which must hold the identity)
    and, if given, puts the tree nodes' ``positions`` back to linear."""
    num_reqs, depth_slots = path.shape
    src = torch.empty(num_drafts, dtype=torch.long, device=path.device)
    dst = torch.empty_like(src)
    if num_reqs:
        _path_first_kernel[(num_reqs,)](
            path,
            num_nodes,
            root_index,
            draft_start,
            src,
            dst,
            order,
            positions if positions is not None else order,
            path.stride(0),
            depth_slots - 1,
            NP=_nodes_tile(width),
            DP=_depth_tile(depth_slots - 1),
            RESTORE=positions is not None,
        )
    return src, dst


def warm_up_verify_step(
    path: torch.Tensor, width: int, budget: int, restore_positions: bool
) -> None:
    """Compile both kernels for one row of ``width`` nodes and the walk's
    ``path`` (``[1, depth + 1]``) on dummies with the dtypes, and pointer
    alignments, of the runners' calls (see ``compile_variants``)."""
    device = path.device
    as_long = dict(dtype=torch.long, device=device)
    one = torch.ones(1, **as_long)
    num_nodes = one * width
    shapes = torch.zeros(1, 2, budget, **as_long)
    positions = torch.zeros(width, **as_long)
    lay_out_trees_triton(
        torch.zeros(1, dtype=torch.int32, device=device),
        shapes[:, 0],
        shapes[:, 1],
        num_nodes,
        one - 1,
        positions,
        one - 1,
        torch.full((1,), width, dtype=torch.int32, device=device),
        1,
        width,
    )
    path_first_moves_triton(
        path,
        num_nodes,
        one - 1,
        one - 1,
        width - 1,
        width,
        torch.arange(width, **as_long),
        positions if restore_positions else None,
    )
