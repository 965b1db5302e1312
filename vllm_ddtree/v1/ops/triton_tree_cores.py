# SPDX-License-Identifier: Apache-2.0
"""Triton forms of the per-step tree cores of :mod:`vllm_ddtree.v1.spec_decode.tree`.

The torch cores are written as a few batched operations per tree depth, so
one step issues well over a hundred tiny kernels; on a GPU each of them costs
a launch (measured on the H200, eager torch: the walk 3.4 ms, the ancestor
mask 1.75 ms per step, whatever the batch size). Here each core is one
launch, one program per request holding the whole tree (at most a few
hundred nodes) in registers. Results are identical to the torch cores, which
stay the CPU path and the tests' oracle.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_ddtree.v1.ops.triton_kv_commit import (
    SlotRowsCommit,
    layer_rows_at,
    move_path_rows,
)
from vllm_ddtree.v1.spec_decode.tree import DraftTrees, WalkResult

# Arguments that change from step to step are not specialised on (Triton
# would otherwise compile a variant per value class mid-serving), and the
# register tiles are bucketed (at least 64 nodes, 16 depths) for the same
# reason.
_MIN_NODES_TILE = 64
_MIN_DEPTH_TILE = 16


@triton.jit
def _path_first_row(
    path,  # [DP]: the row's accepted path, -1 after it
    steps,  # [DP]: 0, 1, ...
    j,  # [NP]: 0, 1, ...
    n,  # the row's node count
    root,  # batch token of the row's root
    ORDER,
    POSITIONS,
    RESTORE: tl.constexpr,
):
    """Put a row's accepted path first, its other nodes after it in node
    order: node ``j`` (batch token ``root + j``) goes to ``root + slot``
    (``ORDER[root + slot] = root + j``); with ``RESTORE`` the nodes' linear
    positions come back."""
    on_step = (path[:, None] == j[None, :]) & (path[:, None] >= 0)
    on_path = tl.sum(on_step.to(tl.int32), axis=0) > 0
    path_slot = tl.sum(tl.where(on_step, steps[:, None], 0), axis=0)
    path_len = tl.sum((path >= 0).to(tl.int32), axis=0)
    off_path = (j < n) & ~on_path
    rank = tl.cumsum(off_path.to(tl.int32), axis=0) - 1
    slot = tl.where(on_path, path_slot, path_len + rank).to(tl.int64)
    node = (j > 0) & (j < n)
    tl.store(ORDER + root + slot, root + j, mask=node)
    if RESTORE:
        root_pos = tl.load(POSITIONS + root)
        tl.store(POSITIONS + root + j, root_pos + j, mask=node)


@triton.jit(
    do_not_specialize=[
        "stride_tok",
        "stride_par",
        "stride_tgt",
        "stride_path",
        "stride_out",
        "max_depth",
    ]
)
def _walk_kernel(
    NODE_TOKENS,
    PARENTS,
    NUM_NODES,
    TARGET,
    TOKEN_ROWS,
    TARGET_ROWS,
    PATH,
    NUM_ACCEPTED,
    BONUS,
    OUT,
    ROOT,  # the path-first order's inputs and outputs (PATH_FIRST) ...
    ORDER,
    POSITIONS,  # ... (see _path_first_row)
    LAYER_ROWS,  # the accepted paths' KV commit (KV_COMMIT) ...
    ANY_ROWS,
    SLOT_MAPPING,
    commit_width,
    row_stride,  # ... (see SlotRowsCommit.kernel_args)
    stride_tok,
    stride_par,
    stride_tgt,
    stride_path,
    stride_out,
    max_depth,
    NP: tl.constexpr,
    DP: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    GATHER: tl.constexpr,
    PATH_FIRST: tl.constexpr,
    RESTORE: tl.constexpr,
    KV_COMMIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # With KV_COMMIT, program (r, layer) walks request r's tree and moves
    # its path in that layer; the first layer's program writes the walk.
    r = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    idx = tl.arange(0, NP)
    n = tl.load(NUM_NODES + r).to(tl.int32)
    valid = idx < n
    par = tl.load(PARENTS + r * stride_par + idx, mask=valid, other=-2).to(tl.int32)
    if GATHER:
        # Flat per-row tokens and targets, node j of request r at row
        # *_ROWS[r, j] (the strides are the maps').
        tok_at = tl.load(TOKEN_ROWS + r * stride_tok + idx, mask=valid, other=0)
        tgt_at = tl.load(TARGET_ROWS + r * stride_tgt + idx, mask=valid, other=0)
        tok = tl.load(NODE_TOKENS + tok_at, mask=valid & (idx > 0), other=-1)
        tgt = tl.load(TARGET + tgt_at, mask=valid, other=0)
    else:
        tok = tl.load(NODE_TOKENS + r * stride_tok + idx, mask=valid, other=-1)
        tgt = tl.load(TARGET + r * stride_tgt + idx, mask=valid, other=0)
    steps = tl.arange(0, DP)
    path = tl.where(steps == 0, 0, -1)
    cur = n * 0
    done = n * 0
    for step in range(1, max_depth + 1):
        want = tl.sum(tl.where(idx == cur, tgt, 0), axis=0)
        hit = (par == cur) & (tok == want) & (idx > 0) & valid
        nxt = tl.min(tl.where(hit, idx, NP), axis=0)
        found = (nxt < NP) & (done == 0)
        cur = tl.where(found, nxt, cur)
        path = tl.where(steps == step, tl.where(found, nxt, -1), path)
        done = tl.where(found, done, 1)
    if KV_COMMIT:
        move_path_rows(
            layer_rows_at(LAYER_ROWS, ANY_ROWS, layer),
            SLOT_MAPPING,
            tl.load(ROOT + r),
            path,
            steps,
            max_depth,
            commit_width,
            row_stride,
            BLOCK,
        )
    if layer == 0:
        accepted = tl.sum(((steps > 0) & (path >= 0)).to(tl.int32), axis=0)
        bonus = tl.sum(tl.where(idx == cur, tgt, 0), axis=0)
        tl.store(PATH + r * stride_path + steps, path, mask=steps <= max_depth)
        tl.store(NUM_ACCEPTED + r, accepted)
        tl.store(BONUS + r, bonus)
        if WRITE_OUT:
            # vLLM's sampler row: the accepted drafted tokens, then the bonus.
            on_step = idx[None, :] == path[:, None]
            path_tok = tl.sum(tl.where(on_step, tok[None, :], 0), axis=1)
            keep = (steps > 0) & (steps <= accepted)
            row = OUT + r * stride_out
            tl.store(row + steps - 1, path_tok, mask=keep)
            tl.store(row + accepted, bonus)
        if PATH_FIRST:
            _path_first_row(
                path,
                steps,
                idx,
                n,
                tl.load(ROOT + r),
                ORDER,
                POSITIONS,
                RESTORE,
            )


def aligned_planes(
    num_planes: int, shape: tuple[int, ...], dtype: torch.dtype, device
) -> torch.Tensor:
    """An empty ``[num_planes, *shape]`` tensor whose every plane starts on a
    16-byte boundary, as a fresh allocation does. Kernels that take one
    pointer per plane are specialised by Triton on each pointer's
    alignment; packed planes would change it with the batch size (an odd
    ``R * B``), compiling another variant mid-serving."""
    numel = math.prod(shape)
    per_16_bytes = 16 // dtype.itemsize
    plane = -(-numel // per_16_bytes) * per_16_bytes
    flat = torch.empty(num_planes, plane, dtype=dtype, device=device)
    return flat[:, :numel].view(num_planes, *shape)


class PathFirstOrder(NamedTuple):
    """The outputs of a launch that knows the accepted paths and also puts
    each request's path first
    (:func:`~vllm_ddtree.v1.worker.verify_plan.path_first_order`): ``order``
    (the identity on entry) receives the batch token whose data goes to
    each token, and ``positions``, if given, gets the nodes' linear
    positions back from their roots' (``root[r]``: batch token of request
    ``r``'s root)."""

    root: torch.Tensor
    order: torch.Tensor
    positions: torch.Tensor | None

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        positions = self.positions if self.positions is not None else self.order
        return (self.root, self.order, positions)


def _nodes_tile(num_nodes: int) -> int:
    return max(_MIN_NODES_TILE, triton.next_power_of_2(num_nodes))


def _depth_tile(max_depth: int) -> int:
    return max(_MIN_DEPTH_TILE, triton.next_power_of_2(max_depth + 1))


def walk_trees_triton(
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_tokens: torch.Tensor,
    max_depth: int,
    out: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
    target_rows: torch.Tensor | None = None,
    path_first: PathFirstOrder | None = None,
    kv_commit: tuple[SlotRowsCommit, torch.Tensor] | None = None,
) -> WalkResult:
    """:func:`~vllm_ddtree.v1.spec_decode.tree.walk_trees` in one launch.

    If ``out`` (``[R, W]``, ``W > `` any accepted length, pre-filled with the
    placeholder) is given, row ``r`` also receives the accepted drafted tokens
    followed by the bonus token: vLLM's sampler-output row.

    With ``token_rows`` and ``target_rows`` (``[R, N]`` maps, both or
    neither) ``node_tokens`` and ``target_tokens`` are the runner's flat
    rows (draft tokens, logit rows' choices), read at
    ``node_tokens[token_rows[r, j]]`` and ``target_tokens[target_rows[r,
    j]]`` for node ``j`` of request ``r`` (the root's token is not read):
    no gathered copies.

    With ``path_first`` the same launch also writes the path-first order
    of the walked paths there (see :class:`PathFirstOrder`), and with
    ``kv_commit`` (a group's commit and the step's slot mapping; needs
    ``path_first``, whose roots it uses) it also moves the accepted paths'
    KV in every layer of the group, as that commit would after the walk:
    the grid is then requests x layers, each program walking its request's
    tree (a few hundred register operations) and moving its path in its
    layer, the first layer's programs writing the walk.
    """
    gather = token_rows is not None
    num_reqs, n = (token_rows if gather else node_tokens).shape
    device = node_tokens.device
    path = torch.empty(num_reqs, max_depth + 1, dtype=torch.long, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.long, device=device)
    bonus = torch.empty(num_reqs, dtype=target_tokens.dtype, device=device)
    if kv_commit is not None:
        assert path_first is not None, "the walk's KV commit needs the roots"
        commit, slot_mapping = kv_commit
        commit_args, num_layers, block = (
            commit.kernel_args(slot_mapping),
            commit.num_layers,
            commit.block,
        )
    else:
        commit_args, num_layers, block = (path, path, path, 0, 0), 1, 1
    if num_reqs:
        tok_map = token_rows if gather else node_tokens
        tgt_map = target_rows if gather else target_tokens
        _walk_kernel[(num_reqs, num_layers)](
            node_tokens,
            parents,
            num_nodes,
            target_tokens,
            tok_map,
            tgt_map,
            path,
            num_accepted,
            bonus,
            out if out is not None else path,
            *(path_first.kernel_args() if path_first else (path,) * 3),
            *commit_args,
            tok_map.stride(0),
            parents.stride(0),
            tgt_map.stride(0),
            path.stride(0),
            out.stride(0) if out is not None else 0,
            max_depth,
            NP=_nodes_tile(n),
            DP=_depth_tile(max_depth),
            WRITE_OUT=out is not None,
            GATHER=gather,
            PATH_FIRST=path_first is not None,
            RESTORE=path_first is not None and path_first.positions is not None,
            KV_COMMIT=kv_commit is not None,
            BLOCK=block,
        )
    return WalkResult(path=path, num_accepted=num_accepted, bonus=bonus)


@triton.jit(do_not_specialize=["stride_par", "stride_packed", "num_words", "max_depth"])
def _ancestor_bits_kernel(
    PARENTS,
    NUM_NODES,
    ROW_START,
    PACKED,
    stride_par,
    stride_packed,
    num_words,
    max_depth,
    NP: tl.constexpr,
    WP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    _store_ancestor_bits(
        PARENTS + r * stride_par,
        tl.load(NUM_NODES + r).to(tl.int32),
        PACKED + tl.load(ROW_START + r).to(tl.int64) * stride_packed,
        stride_packed,
        num_words,
        max_depth,
        NP,
        WP,
    )


@triton.jit
def _store_ancestor_bits(
    ROW_PARENTS,  # the row's parents (root -1)
    n,
    OUT,  # the row's first mask row
    stride_out,
    num_words,
    max_depth,
    NP: tl.constexpr,
    WP: tl.constexpr,
):
    """Write the bit-packed ancestor-or-self masks of one row's ``n`` nodes
    (depths at most ``max_depth``) to ``OUT``, one mask row per node."""
    idx = tl.arange(0, NP)
    words = tl.arange(0, WP)
    valid = idx < n
    # Every node climbs its ancestor chain at once, setting one bit a level.
    cur = tl.where(valid, idx, -1)
    bits = tl.zeros((NP, WP), dtype=tl.int32)
    one = tl.full((NP,), 1, dtype=tl.int32)
    for _ in range(max_depth + 1):
        alive = cur >= 0
        safe = tl.maximum(cur, 0)
        hit = alive[:, None] & (words[None, :] == (safe // 32)[:, None])
        bits = bits | tl.where(hit, (one << (safe % 32))[:, None], 0)
        up = tl.load(ROW_PARENTS + safe, mask=alive, other=-1)
        cur = tl.where(alive, up.to(tl.int32), -1)
    ptrs = OUT + idx.to(tl.int64)[:, None] * stride_out + words[None, :]
    tl.store(ptrs, bits, mask=valid[:, None] & (words[None, :] < num_words))


def packed_ancestor_mask_triton(
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    row_start: torch.Tensor,
    total_rows: int,
    max_depth: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The bit-packed ancestor-or-self masks of
    :func:`~vllm_ddtree.v1.attention.backends.tree_attn.pack_ancestor_mask`,
    straight from the parents (no ``[R, N, N]`` intermediate).

    ``parents`` is ``[R, N]`` (root ``-1``), ``row_start`` the first output
    row of each request, ``total_rows = sum(num_nodes)``; every node's depth
    is at most ``max_depth``. With ``out`` (``[total_rows, ceil(N / 32)]``
    int32, words contiguous) the masks are written there and ``out`` is
    returned.
    """
    num_reqs, n = parents.shape
    num_words = (n + 31) // 32
    if out is None:
        packed = torch.empty(
            total_rows, num_words, dtype=torch.int32, device=parents.device
        )
    else:
        assert out.shape == (total_rows, num_words) and out.dtype == torch.int32
        assert out.stride(1) == 1, "the words of a mask row must be contiguous"
        packed = out
    if num_reqs:
        _ancestor_bits_kernel[(num_reqs,)](
            parents,
            num_nodes,
            row_start,
            packed,
            parents.stride(0),
            packed.stride(0),
            num_words,
            max_depth,
            NP=_nodes_tile(n),
            WP=_nodes_tile(n) // 32,
        )
    return packed


# Largest padded candidate list a build program sorts in registers; bigger
# budgets fall back to the torch build.
_MAX_SORT = 4096
_PAIR_TABLES: dict[tuple, torch.Tensor] = {}


def _pair_table(budget: int, width: int, force_spine: bool, device) -> torch.Tensor:
    """``[2, P]`` int32 (parent slot, token rank) pairs that can reach the
    final tree, padded with parent slot ``budget`` (never valid).

    Parents and ranks are both sorted by key, so candidate ``(i, j)`` comes
    after the ``(i + 1) * (j + 1) - 1`` other candidates ``(i' <= i, j' <= j)``
    of its depth (ties go to the smaller index in the stable order). Below
    depth 1 it also comes after its parent and the parent's ``i`` seniors
    (log-probabilities are <= 0, so a child's key never passes its
    parent's, and ties go to the earlier depth), so it can only be one of
    the ``budget`` nodes if ``(i + 1) * (j + 2) <= budget``; depth 1 keeps
    every rank of the root. The pairs of the bound are a superset of the
    final tree's, closed under smaller ``i`` and ``j``; at ``budget = 64``
    they are 217 instead of the 280 of the per-depth bound, which halves
    the sort (256 slots instead of 512). With ``force_spine`` the spine
    parent (slot 0) only dominates through its rank-0 child, so only the
    per-depth bound holds: ``i * (j + 1) + 1 <= budget`` for ``i >= 1``
    (and ``j < width <= budget`` admits every rank of slot 0 either way).
    """
    key = (budget, width, force_spine, device)
    table = _PAIR_TABLES.get(key)
    if table is None:
        pairs = [
            (i, j)
            for i in range(budget)
            for j in range(width)
            if i == 0
            or (i * (j + 1) + 1 if force_spine else (i + 1) * (j + 2)) <= budget
        ]
        size = triton.next_power_of_2(len(pairs))
        pairs += [(budget, 0)] * (size - len(pairs))
        table = torch.tensor(pairs, dtype=torch.int32).T.contiguous().to(device)
        _PAIR_TABLES[key] = table
    return table


@triton.jit
def _sortable(key, index, max_index):
    """int64 whose descending order is ``key`` descending, then ``index``
    ascending (a stable descending sort); -0.0 counts as +0.0."""
    bits = (key + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (max_index - index).to(tl.int64)


@triton.jit
def _low_word(packed):
    """The low 32 bits of an int64, as a non-negative int64 (the index part
    of :func:`_sortable`)."""
    return packed - ((packed >> 32) << 32)


@triton.jit
def _child_keys(
    depth_logprobs,
    parent_keys,
    i,
    j,
    ok,
    first_depth,
    spine_priority,
    FORCE_SPINE: tl.constexpr,
):
    """Sort keys of children ``(parent slot i, token rank j)``: the parent's
    key plus the token's log-probability; with ``FORCE_SPINE`` the spine's
    priority is taken back from every child but the rank-0 one."""
    if first_depth:
        p_key = tl.zeros(i.shape, dtype=tl.float32)
        if FORCE_SPINE:
            p_key = p_key + spine_priority
    else:
        p_key = tl.load(parent_keys + i, mask=ok, other=0.0)
    key = p_key + tl.load(depth_logprobs + j, mask=ok, other=0.0)
    if FORCE_SPINE:
        key = key - tl.where(
            (p_key >= spine_priority / 2) & (j > 0), spine_priority, 0.0
        )
    return key


@triton.jit
def _build_kernel(
    LOGPROBS,
    TOKENS,
    PAIRS,
    SCR_KEY,
    SCR_SCORE,
    SCR_INT,
    OUT_TOKENS,
    OUT_PARENTS,
    OUT_DEPTHS,
    OUT_SCORES,
    stride_lr,
    stride_ld,
    stride_tr,
    stride_td,
    stride_scr,
    stride_out,
    depth_limit,
    budget,
    width,
    num_pairs,
    FORCE_SPINE: tl.constexpr,
    CP: tl.constexpr,
    TP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    spine_priority = 1.0e9
    # Per-request scratch (all depths' winners, depth-major like the torch
    # build's concatenation): keys, scores and, in SCR_INT, four int rows:
    # token, parent position, depth, node id.
    scr_key = SCR_KEY + r * stride_scr
    scr_score = SCR_SCORE + r * stride_scr
    scr_tok = SCR_INT + (4 * r) * stride_scr
    scr_ppos = scr_tok + stride_scr
    scr_depth = scr_ppos + stride_scr
    scr_node = scr_depth + stride_scr

    c = tl.arange(0, CP)
    pair_i = tl.load(PAIRS + c)
    pair_j = tl.load(PAIRS + num_pairs + c)
    rank = tl.arange(0, CP)
    count_prev = tl.full((), 1, tl.int32)
    offset_prev = tl.full((), 0, tl.int32)
    offset = tl.full((), 0, tl.int32)
    for d in range(depth_limit):
        # Candidates (parent slot i, token rank j), keyed like the torch build;
        # the depth keeps the best ``budget`` of those the pair table lets in.
        ok = (pair_i < count_prev) & (pair_j < width)
        count = tl.minimum(budget, tl.sum(ok.to(tl.int32), axis=0))
        key = _child_keys(
            LOGPROBS + r * stride_lr + d * stride_ld,
            scr_key + offset_prev,
            pair_i,
            pair_j,
            ok,
            d == 0,
            spine_priority,
            FORCE_SPINE,
        )
        packed = _sortable(key, pair_i * width + pair_j, budget * width)
        packed = tl.where(ok, packed, -9223372036854775807 - 1)
        order = tl.sort(packed, descending=True)
        # The depth's winners, best first: recompute their keys and scores
        # with the same float operations.
        win = (budget * width - _low_word(order)).to(tl.int32)
        wi = win // width
        wj = win - wi * width
        keep = rank < count
        w_key = _child_keys(
            LOGPROBS + r * stride_lr + d * stride_ld,
            scr_key + offset_prev,
            wi,
            wj,
            keep,
            d == 0,
            spine_priority,
            FORCE_SPINE,
        )
        w_vals = tl.load(
            LOGPROBS + r * stride_lr + d * stride_ld + wj, mask=keep, other=0.0
        )
        if d == 0:
            w_score = w_vals
            w_ppos = tl.full((CP,), -1, dtype=tl.int32)
        else:
            w_score = tl.load(scr_score + offset_prev + wi, mask=keep, other=0.0)
            w_score = w_score + w_vals
            w_ppos = offset_prev + wi
        w_tok = tl.load(TOKENS + r * stride_tr + d * stride_td + wj, mask=keep)
        tl.store(scr_key + offset + rank, w_key, mask=keep)
        tl.store(scr_score + offset + rank, w_score, mask=keep)
        tl.store(scr_tok + offset + rank, w_tok, mask=keep)
        tl.store(scr_ppos + offset + rank, w_ppos, mask=keep)
        tl.store(scr_depth + offset + rank, rank * 0 + d + 1, mask=keep)
        tl.debug_barrier()
        offset_prev = offset
        offset += count
        count_prev = count

    # The global best ``budget`` of all depths' winners, stable on the
    # depth-major position (parents come first).
    t = tl.arange(0, TP)
    have = t < offset
    all_keys = tl.load(scr_key + t, mask=have, other=0.0)
    packed = _sortable(all_keys, t, TP)
    packed = tl.where(have, packed, -9223372036854775807 - 1)
    order = tl.sort(packed, descending=True)
    sel = (TP - _low_word(order)).to(tl.int32)
    b = tl.arange(0, TP)
    chosen = b < budget
    tl.store(scr_node + sel, b + 1, mask=chosen)
    tl.debug_barrier()
    ppos = tl.load(scr_ppos + sel, mask=chosen, other=-1)
    parent = tl.load(scr_node + tl.maximum(ppos, 0), mask=chosen & (ppos >= 0), other=0)
    out = r * stride_out + b
    tl.store(OUT_TOKENS + out, tl.load(scr_tok + sel, mask=chosen), mask=chosen)
    tl.store(OUT_PARENTS + out, parent, mask=chosen)
    tl.store(OUT_DEPTHS + out, tl.load(scr_depth + sel, mask=chosen), mask=chosen)
    tl.store(OUT_SCORES + out, tl.load(scr_score + sel, mask=chosen), mask=chosen)


def build_trees_triton(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    force_spine: bool = False,
    num_warps: int | None = None,
) -> DraftTrees | None:
    """:func:`~vllm_ddtree.v1.spec_decode.tree.build_trees` in one launch:
    one program per request, one register sort per depth over the candidate
    pairs that can still make the depth's top ``budget``, then one sort over
    all depths' winners. Returns ``None`` when the candidate lists are too
    long to sort in registers (the caller uses the torch build).
    ``num_warps`` sizes each request's program (a tuning knob: a program's
    sorts run one after the other, so fewer warps can finish sooner;
    ``benchmarks/bench_tree_cores.py --build-warps`` times the choices). By
    default 8, and 16 for sorts of 4096 slots (B = 256: 0.37 ms instead of
    0.51 on an H100; B = 64: 8 warps 37 us, 16 warps 43 us)."""
    num_reqs, depth_limit, k = topk_logprobs.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    width = min(budget, k)
    counts, count = [], 1
    for _ in range(depth_limit):
        count = min(budget, count * width)
        counts.append(count)
    total = sum(counts)
    if total < budget:
        raise ValueError(
            f"budget {budget} exceeds the {total} prefixes available "
            f"from {depth_limit} depths x top-{k} tokens"
        )
    device = topk_logprobs.device
    pairs = _pair_table(budget, width, force_spine, device)
    total_p2 = triton.next_power_of_2(total)
    if max(pairs.shape[1], total_p2) > _MAX_SORT:
        return None
    if num_warps is None:
        num_warps = 16 if total_p2 >= 4096 else 8
    logprobs = topk_logprobs.float()
    tokens = topk_tokens.long()
    scr_f = aligned_planes(2, (num_reqs, total), torch.float32, device)
    scr_i = torch.empty(num_reqs, 4, total, dtype=torch.long, device=device)
    out_i = aligned_planes(3, (num_reqs, budget), torch.long, device)
    scores = torch.empty(num_reqs, budget, dtype=torch.float32, device=device)
    if num_reqs:
        _build_kernel[(num_reqs,)](
            logprobs,
            tokens,
            pairs,
            scr_f[0],
            scr_f[1],
            scr_i,
            out_i[0],
            out_i[1],
            out_i[2],
            scores,
            logprobs.stride(0),
            logprobs.stride(1),
            tokens.stride(0),
            tokens.stride(1),
            total,
            budget,
            depth_limit,
            budget,
            width,
            pairs.shape[1],
            FORCE_SPINE=force_spine,
            CP=pairs.shape[1],
            TP=total_p2,
            num_warps=num_warps,
        )
    return DraftTrees(tokens=out_i[0], parents=out_i[1], depths=out_i[2], scores=scores)


def compile_variants(
    device: torch.device,
    budget: int,
    max_depth: int,
    top_k: int,
    force_spine: bool,
    out_dtype: torch.dtype,
    v2_runner: bool,
    kv_commit: tuple[SlotRowsCommit, torch.Tensor] | None = None,
) -> list[tuple[int, int]]:
    """Launch every variant of the kernels that an engine with this budget
    can use (the build; the walk, the masks and the runner's lay-out and
    path-first order of :mod:`~vllm_ddtree.v1.ops.triton_verify_step` for
    every node-tile size up to ``budget + 1`` nodes, the walk and the order
    also for every depth tile a batch verified as a chain reaches: its depth
    bound is its width - 1), so that Triton compiles them at start-up rather
    than mid-serving. Inputs are dummies with the dtypes of the real calls;
    ``out_dtype`` is that of the sampler-output rows the walk writes (Triton
    compiles a kernel per pointer dtype), ``v2_runner`` whose lay-out and
    path-first order to compile (see ``warm_up_verify_step``), ``kv_commit``
    the V2 runner's walk's (whose moves are made on all-zero slots here).
    Returns the walk's (node tile, depth tile) variants."""
    # Imported here: that module builds on this one's tiles.
    from vllm_ddtree.v1.ops.triton_verify_step import warm_up_verify_step

    as_long = dict(dtype=torch.long, device=device)
    build_trees_triton(
        torch.zeros(1, max_depth, top_k, device=device),
        torch.zeros(1, max_depth, top_k, **as_long),
        budget,
        force_spine,
    )
    on_zero_slots = None
    if kv_commit is not None:
        commit, slot_mapping = kv_commit
        on_zero_slots = (commit, slot_mapping.new_zeros(budget + 1))
    walks = {
        (_nodes_tile(w), _depth_tile(d)): (w, d)
        for w in range(1, budget + 2)
        for d in (max_depth, w - 1)
    }
    for width, depth in walks.values():
        # As the samplers call it: int32 draft tokens and int64 choices read
        # through the layout's row maps.
        rows = torch.zeros(1, width, **as_long)
        walk = functools.partial(
            walk_trees_triton,
            torch.zeros(width, dtype=torch.int32, device=device),
            torch.arange(-1, width - 1, **as_long)[None],
            torch.full((1,), width, **as_long),
            torch.zeros(width, **as_long),
            depth,
            torch.zeros(1, width + 1, dtype=out_dtype, device=device),
            rows,
            rows,
            kv_commit=on_zero_slots,
        )
        warm_up_verify_step(walk, width, budget, v2_runner, device)
    widths = {_nodes_tile(w): w for w in range(1, budget + 2)}
    for width in widths.values():
        parents = torch.arange(-1, width - 1, **as_long)[None]
        as_i32 = dict(dtype=torch.int32, device=device)
        packed_ancestor_mask_triton(
            parents,
            torch.full((1,), width, **as_i32),
            torch.zeros(1, **as_i32),
            width,
            max_depth,
        )
    return sorted(walks)
