# SPDX-License-Identifier: Apache-2.0
"""The layout of a tree-verify batch and the accepted path's commit, shared
by the DDTree runners on vLLM's V1 and V2 model runners.

A verify batch holds, per request, a root and a best-first prefix of its
tree's nodes as consecutive tokens (vLLM schedules them as draft tokens).
:func:`stage_layout` derives the index arrays of that layout on the host from
the scheduler's counts and sends them in one copy; the runners add the
trees' parents (gathered on the device) to make a :class:`VerifyPlan`. After
the walk, :func:`path_moves` says which node's KV goes to which slot so that
the accepted path sits where a chain would have it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_ddtree.v1.attention.backends.tree_attn import TreeAttentionInfo
from vllm_ddtree.v1.sample.tree_rejection_sampler import VerifyRows
from vllm_ddtree.v1.spec_decode.tree import path_first_permutation
from vllm_ddtree.v1.worker.host_staging import HostStaging


@dataclass
class StagedLayout:
    """Index arrays of a verify batch (``num_nodes[r]`` query tokens of
    request ``r``, root included, ending at ``query_end[r]``).

    Device tensors: ``num_nodes``, ``root_index`` (batch token of each root);
    ``node_tokens`` / ``node_rows`` / ``node_ids`` list every non-root node,
    flattened, as batch token, request row and node index; ``tree_rows`` are
    the rows with drafts, with their ``tree_nodes`` and ``tree_q_start``;
    ``rows`` the sampler's maps; ``extra`` any arrays the caller added to the
    copy. ``width`` is the widest row, ``total`` the batch's token count; the
    ``host_*`` arrays are what the tree attention info needs on the host.
    """

    num_nodes: torch.Tensor
    root_index: torch.Tensor
    node_tokens: torch.Tensor
    node_rows: torch.Tensor
    node_ids: torch.Tensor
    tree_rows: torch.Tensor
    tree_nodes: torch.Tensor
    tree_q_start: torch.Tensor
    rows: VerifyRows
    extra: list[torch.Tensor]
    width: int
    total: int
    host_num_nodes: np.ndarray
    host_root_index: np.ndarray
    host_tree_rows: np.ndarray


def stage_layout(
    staging: HostStaging,
    num_nodes: np.ndarray,
    query_end: np.ndarray,
    extra: tuple[np.ndarray, ...] = (),
) -> StagedLayout:
    """Lay the batch out on the host and upload it (with ``extra``) in one
    non-blocking copy, made while the GPU is idle."""
    num_nodes = num_nodes.astype(np.int64)
    query_end = query_end.astype(np.int64)
    root_index = query_end - num_nodes
    rows_host = VerifyRows.host_arrays(num_nodes - 1)
    node_rows, node_ids = np.nonzero(rows_host[3])
    tree_rows = np.nonzero(num_nodes > 1)[0]
    uploaded = staging.upload(
        num_nodes,
        root_index,
        root_index[node_rows] + node_ids,
        node_rows,
        node_ids,
        tree_rows,
        num_nodes[tree_rows],
        root_index[tree_rows],
        *rows_host,
        *extra,
    )
    num_rows = len(rows_host)
    return StagedLayout(
        *uploaded[:8],
        rows=VerifyRows.from_device(uploaded[8 : 8 + num_rows]),
        extra=uploaded[8 + num_rows :],
        width=int(num_nodes.max()),
        total=int(query_end[-1]),
        host_num_nodes=num_nodes,
        host_root_index=root_index,
        host_tree_rows=tree_rows,
    )


def tree_attention_info(
    layout: StagedLayout,
    parents: torch.Tensor,
    seq_lens: torch.Tensor,
    ctx_len_bound: np.ndarray,
    max_depth: int,
) -> TreeAttentionInfo | None:
    """The tree rows of the batch for the tree attention backends; ``None``
    without any. ``seq_lens`` are the device's sequence lengths (tree
    included); ``ctx_len_bound`` the host's bounds of the contexts (under
    async scheduling the host counts every draft of the last step as
    accepted)."""
    tree_rows = layout.host_tree_rows
    if not len(tree_rows):
        return None
    i32 = torch.int32
    counts = layout.host_num_nodes[tree_rows]
    return TreeAttentionInfo(
        req_rows=layout.tree_rows.to(i32),
        q_start=layout.tree_q_start.to(i32),
        num_nodes=layout.tree_nodes.to(i32),
        ctx_len=seq_lens[layout.tree_rows] - layout.tree_nodes.to(i32),
        parents=parents[layout.tree_rows],
        max_depth=max_depth,
        req_rows_cpu=tree_rows.tolist(),
        q_start_cpu=layout.host_root_index[tree_rows].tolist(),
        num_nodes_cpu=counts.tolist(),
        ctx_len_cpu=ctx_len_bound[tree_rows].tolist(),
        covers_batch=int(counts.sum()) == layout.total,
    )


def depth_shift(layout: StagedLayout, depths: torch.Tensor) -> torch.Tensor:
    """Per non-root node, what moves it from its linear position (root + node
    index) to its depth position (root + depth)."""
    return depths[layout.node_rows, layout.node_ids] - layout.node_ids


@dataclass
class VerifyPlan:
    """A verify step's layout, kept from input preparation to the commit.
    ``linear_positions`` are the batch's positions before the depth rewrite
    (``[3, tokens]`` for M-RoPE targets, else ``[tokens]``)."""

    layout: StagedLayout
    linear_positions: torch.Tensor
    tree: TreeAttentionInfo | None


def path_moves(
    layout: StagedLayout, path: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)`` batch tokens: the node at ``src[i]`` belongs at
    ``dst[i]`` once every request's accepted path (``path``, the walk's) is
    put first, the rejected nodes after it in node order."""
    perm = path_first_permutation(path, layout.width)
    rows = layout.node_rows
    src = layout.root_index[rows] + perm[rows, layout.node_ids]
    return src, layout.node_tokens


def path_first_order(
    src: torch.Tensor, dst: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``order[i]``: the batch token whose data goes to token ``i`` (the
    accepted path first; tokens outside trees stay)."""
    order = torch.arange(num_tokens, device=src.device)
    order[dst] = src
    return order


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
    src_tokens: torch.Tensor,
    dst_tokens: torch.Tensor,
) -> None:
    """Move the KV of batch token ``src_tokens[i]`` to the slot of token
    ``dst_tokens[i]`` in every layer of ``plan`` (``slot_mapping(gid)``: the
    step's slot of every batch token in KV-cache group ``gid``)."""
    for gid, (layers, commit) in plan.items():
        slots = slot_mapping(gid)
        src, dst = slots[src_tokens], slots[dst_tokens]
        if commit is not None:
            commit(src, dst)
            continue
        for impl, kv_cache in layers:
            impl.copy_kv_slots(kv_cache, src, dst)
