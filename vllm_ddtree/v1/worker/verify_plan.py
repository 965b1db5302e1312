# SPDX-License-Identifier: Apache-2.0
"""The layout of a tree-verify batch and the accepted path's commit, shared
by the DDTree runners on vLLM's V1 and V2 model runners.

A verify batch holds, per request, a root and a best-first prefix of its
tree's nodes as consecutive tokens (vLLM schedules them as draft tokens).
:func:`stage_layout` derives the index arrays of that layout on the host from
the scheduler's counts and sends them in one copy (:class:`LayoutStager`
reuses them while the layout repeats); :func:`lay_out_trees` adds every
row's parents (gathered on the device from the last proposal) and moves the
nodes to their depth positions (the V1 runner's M-RoPE targets use the
torch pieces, which move three position rows), which makes a
:class:`VerifyPlan`. After the walk, :func:`compact_kv` moves the accepted
path's KV to the slots where a chain would have it, and
:func:`path_first_order` gives the token order that puts the path first
(the drafter reads the target's hidden states in it).

:func:`lay_out_trees` and :func:`path_first_order` are each one Triton
launch on a GPU (:mod:`vllm_ddtree.v1.ops.triton_verify_step`); their torch
forms here are the CPU path and those kernels' oracle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ddtree.v1.attention.backends.tree_attn import (
    TreeAttentionInfo,
    UniformTreeBuffers,
)
from vllm_ddtree.v1.sample.tree_rejection_sampler import VerifyRows
from vllm_ddtree.v1.spec_decode.tree import gather_tree_layout, path_first_permutation
from vllm_ddtree.v1.worker.host_staging import HostStaging


@dataclass
class StagedLayout:
    """Index arrays of a verify batch (``num_nodes[r]`` query tokens of
    request ``r``, root included, ending at ``query_end[r]``).

    Device tensors: ``num_nodes``, ``root_index`` (batch token of each root);
    ``node_tokens`` / ``node_rows`` / ``node_ids`` list every non-root node,
    flattened, as batch token, request row and node index; ``tree_rows``
    are the rows with drafts, with their ``tree_nodes`` and
    ``tree_q_start`` (``tree_index``: each row's index among them, ``-1``
    for none; ``tree_mask_start``: the first row of each one's ancestor
    masks when the trees' masks are packed one after another);
    ``logit_rows`` (``[R, W]``, 0 past a row's nodes) the logit row of
    every node; ``rows`` the V1 sampler's maps (its ``logit_rows`` and
    ``num_nodes`` are the same tensors); ``extra`` any arrays the caller
    added to the copy. Staged without node maps (see :func:`stage_layout`),
    ``node_tokens``, ``node_rows``, ``node_ids`` and ``rows`` are ``None``.
    ``width`` is the widest row, ``total`` the batch's token count,
    ``tree_total`` its tree rows' (the rows of their packed masks); the
    ``host_*`` arrays are what the tree attention info needs on the host:
    the tree rows, their node counts and first tokens.

    With ``chain_rows`` the tree rows are every row of the batch: a row
    without drafts (a prompt or its chunk) is a chain of its query's
    tokens there, so that the tree attention covers the whole batch (see
    :func:`stage_layout`); ``parents_width`` is the widest row counting a
    chain row's query (``width`` without chain rows), the rows' parents'
    width.
    """

    num_nodes: torch.Tensor
    root_index: torch.Tensor
    node_tokens: torch.Tensor | None
    node_rows: torch.Tensor | None
    node_ids: torch.Tensor | None
    tree_rows: torch.Tensor
    tree_nodes: torch.Tensor
    tree_q_start: torch.Tensor
    tree_index: torch.Tensor
    tree_mask_start: torch.Tensor
    logit_rows: torch.Tensor
    rows: VerifyRows | None
    extra: list[torch.Tensor]
    width: int
    total: int
    tree_total: int
    host_tree_rows: np.ndarray
    host_tree_nodes: np.ndarray
    host_tree_q_start: np.ndarray
    chain_rows: bool
    parents_width: int


def stage_layout(
    staging: HostStaging,
    num_nodes: np.ndarray,
    query_end: np.ndarray,
    extra: tuple[np.ndarray, ...] = (),
    chain_rows_upto: int = 0,
    node_maps: bool = True,
) -> StagedLayout:
    """Lay the batch out on the host and upload it (with ``extra``) in one
    non-blocking copy, made while the GPU is idle.

    ``node_maps``: also stage the per-node maps that the torch forms of the
    lay-out and the path-first order, and the V1 runner's sampler, read
    (``node_tokens`` / ``node_rows`` / ``node_ids`` and ``rows``). The V2
    runner's Triton launches find every node from its row's first token and
    node count and read only ``logit_rows``: without the maps a layout's
    staging (new at every step that admits or retires a request) derives
    and uploads eight arrays instead of fourteen.

    ``chain_rows_upto``: when the batch has trees and every row without
    drafts queries at most this many tokens, those rows become tree rows
    too, as chains of their query's tokens (causal attention is the chain's
    ancestor mask). A batch whose rows are all tree rows needs no stock
    attention pass before the tree pass: in a step that prefills short
    prompts beside the trees, every layer then makes one launch instead of
    two (with eager attention, each launch costs the host more than the
    GPU its work on a small target). ``0``: only rows with drafts are tree
    rows. The limit keeps the tree kernel to the tree sizes it was compiled
    for, and long prompts with FlashAttention."""
    num_nodes = num_nodes.astype(np.int64)
    query_end = query_end.astype(np.int64)
    root_index = query_end - num_nodes
    num_drafts = num_nodes - 1
    has_drafts = num_drafts > 0
    # Only a batch with rows of both kinds can have chain rows.
    mixed = chain_rows_upto > 0 and has_drafts.any() and not has_drafts.all()
    query_len = np.diff(query_end, prepend=0) if mixed else None
    chains = bool(mixed) and int(query_len[~has_drafts].max()) <= chain_rows_upto
    if chains:
        tree_rows = np.arange(len(num_nodes))
        tree_nodes = np.where(has_drafts, num_nodes, query_len)
    else:
        tree_rows = np.nonzero(has_drafts)[0]
        tree_nodes = num_nodes[tree_rows]
    tree_index = np.full(len(num_nodes), -1, dtype=np.int64)
    tree_index[tree_rows] = np.arange(len(tree_rows))
    tree_q_start = query_end[tree_rows] - tree_nodes
    if node_maps:
        _, logit_rows, *sampler_maps = VerifyRows.host_arrays(num_drafts)
        _, is_draft, _ = sampler_maps
        node_rows, node_ids = np.nonzero(is_draft)
        maps = (root_index[node_rows] + node_ids, node_rows, node_ids, *sampler_maps)
    else:
        logit_rows, maps = VerifyRows.logit_rows_of(num_nodes), ()
    common = (
        num_nodes,
        root_index,
        logit_rows,
        tree_rows,
        tree_nodes,
        tree_q_start,
        tree_index,
        np.cumsum(tree_nodes) - tree_nodes,
    )
    uploaded = staging.upload(*common, *maps, *extra)
    num_nodes_d, root_index_d, logit_rows_d, *tree_fields = uploaded[: len(common)]
    maps_d = uploaded[len(common) : len(common) + len(maps)]
    node_fields, rows = (None, None, None), None
    if node_maps:
        *node_fields, draft_rows, is_draft, node_req = maps_d
        rows = VerifyRows.from_device(
            [num_nodes_d, logit_rows_d, draft_rows, is_draft, node_req]
        )
    width = int(num_nodes.max())
    return StagedLayout(
        num_nodes_d,
        root_index_d,
        *node_fields,
        *tree_fields,
        logit_rows=logit_rows_d,
        rows=rows,
        extra=uploaded[len(common) + len(maps) :],
        width=width,
        total=int(query_end[-1]),
        tree_total=int(tree_nodes.sum()),
        host_tree_rows=tree_rows,
        host_tree_nodes=tree_nodes,
        host_tree_q_start=tree_q_start,
        chain_rows=chains,
        parents_width=max(width, int(tree_nodes.max(initial=0))),
    )


class LayoutStager:
    """:func:`stage_layout` (rows without drafts of up to
    ``chain_rows_upto`` tokens as chains; the node maps if ``node_maps``)
    keeping the last few layouts it staged.

    In steady decoding every step of a batch has the same layout (the same
    node counts at the same offsets: at batch 1, every step), so its arrays
    are derived and sent to the device once and later steps reuse them; the
    consumers only read them. Keyed by the host arrays the layout is made
    from.
    """

    def __init__(
        self,
        device: torch.device | str,
        capacity: int = 8,
        chain_rows_upto: int = 0,
        node_maps: bool = True,
    ) -> None:
        self.staging = HostStaging(device)
        self.capacity = capacity
        self.chain_rows_upto = chain_rows_upto
        self.node_maps = node_maps
        self._layouts: OrderedDict[tuple, StagedLayout] = OrderedDict()

    def __call__(
        self,
        num_nodes: np.ndarray,
        query_end: np.ndarray,
        extra: tuple[np.ndarray, ...] = (),
    ) -> StagedLayout:
        key = tuple(
            (a.shape, np.asarray(a, dtype=np.int64).tobytes())
            for a in (num_nodes, query_end, *extra)
        )
        layout = self._layouts.get(key)
        if layout is None:
            layout = stage_layout(
                self.staging,
                num_nodes,
                query_end,
                extra,
                self.chain_rows_upto,
                self.node_maps,
            )
            self._layouts[key] = layout
            if len(self._layouts) > self.capacity:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout


@dataclass
class TreeRows:
    """The tree rows of a verify batch (its requests with drafts, in batch
    order) as the tree attention backends take them: batch row, root token,
    node count and context length (``[T]`` int32) and ``parents [T, W]``;
    where the lay-out launch also packed their ancestor masks (one after
    another, ``[sum of node counts, ceil(W / 32)]`` int32), those and each
    tree's first mask row (``[T]`` int32)."""

    req_rows: torch.Tensor
    q_start: torch.Tensor
    num_nodes: torch.Tensor
    ctx_len: torch.Tensor
    parents: torch.Tensor
    packed_mask: tuple[torch.Tensor, torch.Tensor] | None = None


def tree_rows_of(
    layout: StagedLayout, parents: torch.Tensor, seq_lens: torch.Tensor
) -> TreeRows:
    """The tree rows of a batch with row parents ``[R, W]``; ``seq_lens``
    are the device's sequence lengths (tree included)."""
    i32 = torch.int32
    return TreeRows(
        req_rows=layout.tree_rows.to(i32),
        q_start=layout.tree_q_start.to(i32),
        num_nodes=layout.tree_nodes.to(i32),
        ctx_len=seq_lens[layout.tree_rows] - layout.tree_nodes.to(i32),
        parents=parents[layout.tree_rows],
    )


@dataclass
class UniformTarget:
    """Graph buffers that :func:`lay_out_trees` fills for a uniform batch
    (every request a tree of ``buffers.num_nodes`` nodes), for its first
    ``num_reqs`` rows, graph padding included (see :class:`UniformFill`)."""

    buffers: UniformTreeBuffers
    num_reqs: int


def lay_out_trees(
    layout: StagedLayout,
    tree_shapes: tuple[torch.Tensor, torch.Tensor] | None,
    tree_row: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    uniform: UniformTarget | None = None,
) -> tuple[torch.Tensor, TreeRows]:
    """Every row's ``parents [R, W]`` (root column and padding ``-1``) and
    the batch's :class:`TreeRows`, from the proposal trees ``tree_shapes``
    (``(parents, depths)`` as in :class:`DraftTrees`, row ``tree_row[r]``
    for batch row ``r``, ``-1``: a chain; ``None``, no proposal: all chains;
    see :func:`gather_tree_layout`). Moves every node's ``positions``
    (``[tokens]``, linear on entry) to its root's position plus its depth,
    in place. ``uniform`` (GPU only) also fills those graph buffers in the
    same launch; ``parents`` then has a chain row per padding row. A
    layout's chain rows (see :func:`stage_layout`) get their chains in
    ``parents``, as wide as the widest tree row."""
    if positions.is_cuda and tree_shapes is not None:
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_verify_step import lay_out_trees_triton

        return lay_out_trees_triton(
            layout, tree_shapes, tree_row, positions, seq_lens, uniform
        )
    if uniform is not None:
        raise ValueError("filling graph buffers in the lay-out needs a GPU")
    return lay_out_trees_torch(layout, tree_shapes, tree_row, positions, seq_lens)


def lay_out_trees_torch(
    layout: StagedLayout,
    tree_shapes: tuple[torch.Tensor, torch.Tensor] | None,
    tree_row: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, TreeRows]:
    """:func:`lay_out_trees` in torch operations (any device)."""
    parents, depths = gather_tree_layout(
        tree_shapes, tree_row, layout.num_nodes, layout.width
    )
    positions[layout.node_tokens] += depth_shift(layout, depths)
    parents = with_chain_rows(layout, parents)
    return parents, tree_rows_of(layout, parents, seq_lens)


def with_chain_rows(layout: StagedLayout, parents: torch.Tensor) -> torch.Tensor:
    """The rows' parents ``[R, W]`` widened to the widest tree row, with the
    chains of a layout's chain rows (see :func:`stage_layout`)."""
    if not layout.chain_rows:
        return parents
    width = layout.parents_width
    node = torch.arange(width, device=parents.device)
    # Every row is a tree row, in row order.
    chained = (node >= layout.num_nodes[:, None]) & (node < layout.tree_nodes[:, None])
    wide = torch.nn.functional.pad(parents, (0, width - parents.shape[1]), value=-1)
    return torch.where(chained, node - 1, wide)


def tree_attention_info(
    layout: StagedLayout,
    rows: TreeRows,
    seq_len_bound: np.ndarray,
    max_depth: int,
) -> TreeAttentionInfo | None:
    """The tree rows of the batch for the tree attention backends; ``None``
    without any. ``seq_len_bound`` are the host's bounds of the rows'
    sequence lengths, query included (under async scheduling the host
    counts every draft of the last step as accepted); ``max_depth`` bounds
    the trees' depths (a chain row's is its length less one)."""
    tree_rows = layout.host_tree_rows
    if not len(tree_rows):
        return None
    if layout.chain_rows:
        max_depth = max(max_depth, layout.parents_width - 1)
    ctx_len_bound = seq_len_bound[tree_rows] - layout.host_tree_nodes
    return TreeAttentionInfo(
        req_rows=rows.req_rows,
        q_start=rows.q_start,
        num_nodes=rows.num_nodes,
        ctx_len=rows.ctx_len,
        parents=rows.parents,
        max_depth=max_depth,
        req_rows_cpu=tree_rows.tolist(),
        q_start_cpu=layout.host_tree_q_start.tolist(),
        num_nodes_cpu=layout.host_tree_nodes.tolist(),
        ctx_len_cpu=ctx_len_bound.tolist(),
        covers_batch=layout.tree_total == layout.total,
        packed=rows.packed_mask,
    )


def depth_shift(layout: StagedLayout, depths: torch.Tensor) -> torch.Tensor:
    """Per non-root node, what moves it from its linear position (root + node
    index) to its depth position (root + depth)."""
    return depths[layout.node_rows, layout.node_ids] - layout.node_ids


@dataclass
class VerifyPlan:
    """A verify step's layout, kept from input preparation to the commit.
    ``linear_positions`` are the batch's positions before the depth rewrite
    (``[3, tokens]`` for M-RoPE targets, else ``[tokens]``), where the
    runner keeps a copy."""

    layout: StagedLayout
    linear_positions: torch.Tensor | None
    tree: TreeAttentionInfo | None


def path_first_order(
    layout: StagedLayout,
    path: torch.Tensor,
    num_tokens: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The batch's token order with every request's accepted path (``path``,
    the walk's) first and the rejected nodes after it in node order:
    ``order[i]`` (``[num_tokens]``, at least the batch) is the batch token
    whose data goes to token ``i`` (tokens outside trees stay). With
    ``positions`` (``[tokens]``, depth positions) the nodes get their linear
    positions back, in place."""
    if path.is_cuda:
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_verify_step import path_first_order_triton

        return path_first_order_triton(layout, path, num_tokens, positions)
    return path_first_order_torch(layout, path, num_tokens, positions)


def path_first_order_torch(
    layout: StagedLayout,
    path: torch.Tensor,
    num_tokens: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`path_first_order` in torch operations (any device)."""
    order = torch.arange(num_tokens, device=path.device)
    perm = path_first_permutation(path, layout.width)
    # Each node's place in the path-first order (perm's inverse).
    place = torch.empty_like(perm).scatter_(
        1, perm, torch.arange(layout.width, device=perm.device).expand_as(perm)
    )
    rows = layout.node_rows
    roots = layout.root_index[rows]
    order[roots + place[rows, layout.node_ids]] = layout.node_tokens
    if positions is not None:
        positions[layout.node_tokens] = positions[roots] + layout.node_ids
    return order


def path_moves(
    roots: torch.Tensor, path: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted paths' KV moves as batch tokens, ``[R * max_depth]``
    each: the node at depth ``d`` of request ``r`` (``path[r, d]``) goes from
    ``roots[r] + path[r, d]`` to ``roots[r] + d``. Depths past the path, or
    whose node is already in place, move the root onto itself (no slot is
    both a real move's destination and a root), so the count is fixed and
    the host never waits for the device. Every source is read before any
    destination is written (``rows[dst] = rows[src]``)."""
    depth = torch.arange(1, path.shape[1], device=path.device)
    nodes = path[:, 1:]
    moves = nodes > depth
    src = roots[:, None] + torch.where(moves, nodes, 0)
    dst = roots[:, None] + torch.where(moves, depth, 0)
    return src.flatten(), dst.flatten()


KVCommitPlan = dict[int, tuple[list, Callable | None]]


def kv_commit_plan(
    kv_cache_config, forward_context: dict, skip: set[str]
) -> KVCommitPlan:
    """Per attention KV-cache group: its layers' ``(impl, cache)`` (bar the
    ``skip`` ones, the drafter's) and, where the backend offers one, a
    commit of all of them at once."""
    plan: KVCommitPlan = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        layers = [
            (forward_context[name].impl, forward_context[name].kv_cache)
            for name in group.layer_names
            if name not in skip
        ]
        if layers:
            caches = [kv_cache for _, kv_cache in layers]
            plan[gid] = (layers, layers[0][0].kv_commit_for_layers(caches))
    return plan


def compact_kv(
    plan: KVCommitPlan,
    slot_mapping: Callable[[int], torch.Tensor],
    roots: torch.Tensor,
    path: torch.Tensor,
) -> None:
    """Move every request's accepted path (``path``, the walk's; ``roots``:
    the batch token of each request's root) to the tokens right after its
    root in every layer of ``plan`` (``slot_mapping(gid)``: the step's slot
    of every batch token in KV-cache group ``gid``). The rejected nodes'
    slots are left as they are: they lie past the committed tokens, and the
    next step writes there before anything reads them."""
    moves = None
    for gid, (layers, commit) in plan.items():
        slots = slot_mapping(gid)
        if commit is not None:
            commit(slots, roots, path)
            continue
        if moves is None:
            moves = path_moves(roots, path)
        src, dst = slots[moves[0]], slots[moves[1]]
        for impl, kv_cache in layers:
            impl.copy_kv_slots(kv_cache, src, dst)
