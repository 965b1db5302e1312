# SPDX-License-Identifier: Apache-2.0
"""Pure tensor cores of DDTree: tree build, tree walk, path permutation, masks.

Everything here works on batched tensors, on any device, without host syncs
and without knowing anything about vLLM. The engine integration
(``ddtree_proposer``, ``tree_rejection_sampler``, ``ddtree_model_runner``) only
moves data in and out of these functions.

Conventions used throughout:

* A request's tree has ``N = n + 1`` nodes. Node 0 is the *root*: the bonus
  token sampled at the end of the previous step. Nodes ``1..n`` are drafted
  tokens. ``parents[r, i]`` is the parent node index of node ``i``
  (``-1`` for the root and for padding), always ``< i`` (topological order).
* Drafted nodes come out of :func:`build_trees` in best-first order (score
  descending, ties broken by depth then by rank), so *every prefix of the node
  list is itself a valid tree*. The scheduler may cut a request's drafts to a
  prefix (token budget, ``max_model_len``); nothing here needs to care.

The tree build is the GPU form of the paper's best-first heap. Write ``q_d``
for the drafter's distribution at depth ``d`` and ``score(u) = sum_d log
q_d(u_d)``. Because ``q_d`` does not depend on the prefix, if a depth-``d``
prefix is among the ``B`` best depth-``d`` prefixes, its parent is among the
``B`` best depth-``(d-1)`` prefixes (replacing a worse parent by any better one
and keeping the last token gives a better depth-``d`` prefix). So the ``B``
best prefixes of each depth are found among ``(B best of depth d-1) x (top-B
tokens at depth d)``, one sort per depth, and the tree is the global best
``B`` of the per-depth winners. A child never scores above its parent
(log-probabilities are ``<= 0``) and ties are broken towards smaller depth, so
the global best ``B`` are prefix-closed, exactly like the heap's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sort key added to the top-1 chain when ``force_spine`` is set: larger than
# any difference of finite log-probability sums.
_SPINE_PRIORITY = 1.0e9


@dataclass
class DraftTrees:
    """Batched trees produced by :func:`build_trees` (root excluded).

    ``tokens``, ``parents`` and ``depths`` are ``[R, B]``: entry ``j`` is
    node ``j + 1`` of the tree. ``parents`` holds node indices (0 = root),
    ``depths`` is 1 for children of the root.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor


def build_trees(
    topk_logprobs: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int,
    force_spine: bool = False,
) -> DraftTrees:
    """Select the ``budget`` most probable prefixes of each request's draft.

    Args:
        topk_logprobs: ``[R, K, k]`` float, per depth ``1..K`` the ``k``
            largest drafter log-probabilities, sorted descending.
            ``k >= min(budget, vocab)`` is needed for exactness.
        topk_tokens: ``[R, K, k]`` the token ids of those log-probabilities.
        budget: ``B``, the number of tree nodes excluding the root.
        force_spine: keep the drafter's top-1 chain (depths
            ``1..min(K, B)``) in the tree whatever its score.

    Returns:
        :class:`DraftTrees` with ``[R, B]`` tensors in best-first order.
    """
    num_reqs, depth_limit, k = topk_logprobs.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    device = topk_logprobs.device
    logprobs = topk_logprobs.float()
    width = min(budget, k)

    # Per-depth winners, concatenated depth-major in within-depth order.
    all_scores, all_keys, all_tokens, all_parent_pos = [], [], [], []
    # State of the previous depth: scores / sort keys of its winners and the
    # position of each winner inside the concatenated candidate list.
    prev_scores = torch.zeros(num_reqs, 1, device=device)
    prev_keys = torch.zeros(num_reqs, 1, device=device)
    if force_spine:
        prev_keys = prev_keys + _SPINE_PRIORITY
    prev_pos = torch.full((num_reqs, 1), -1, dtype=torch.long, device=device)
    offset = 0
    for d in range(depth_limit):
        vals = logprobs[:, d, :width]  # [R, width]
        toks = topk_tokens[:, d, :width]
        cand_scores = (prev_scores[:, :, None] + vals[:, None, :]).flatten(1)
        # The sort key differs from the score only on the spine: a candidate
        # is on the spine iff its parent is and its token has rank 0.
        cand_keys = prev_keys[:, :, None] + vals[:, None, :]
        if force_spine:
            not_rank0 = torch.zeros(width, device=device)
            not_rank0[1:] = _SPINE_PRIORITY
            on_spine_parent = prev_keys >= _SPINE_PRIORITY / 2
            cand_keys = cand_keys - (
                on_spine_parent[:, :, None].float() * not_rank0[None, None, :]
            )
        cand_keys = cand_keys.flatten(1)
        # Stable descending sort: ties keep (parent order, token rank) order.
        order = torch.sort(cand_keys, dim=1, descending=True, stable=True).indices
        order = order[:, :budget]
        parent_slot = torch.div(order, width, rounding_mode="floor")
        rank = order - parent_slot * width
        prev_scores = torch.gather(cand_scores, 1, order)
        prev_keys = torch.gather(cand_keys, 1, order)
        all_scores.append(prev_scores)
        all_keys.append(prev_keys)
        all_tokens.append(torch.gather(toks, 1, rank))
        all_parent_pos.append(torch.gather(prev_pos, 1, parent_slot))
        count = order.shape[1]
        prev_pos = torch.arange(count, device=device).expand(num_reqs, count) + offset
        offset += count

    scores = torch.cat(all_scores, dim=1)
    keys = torch.cat(all_keys, dim=1)
    tokens = torch.cat(all_tokens, dim=1)
    parent_pos = torch.cat(all_parent_pos, dim=1)
    depth_of = torch.cat(
        [
            torch.full((num_reqs, s.shape[1]), d + 1, dtype=torch.long, device=device)
            for d, s in enumerate(all_scores)
        ],
        dim=1,
    )
    # Candidates are depth-major, so a stable sort on the key alone breaks
    # ties by depth, then by within-depth order: parents always come first.
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    order = order[:, :budget]
    if order.shape[1] < budget:
        raise ValueError(
            f"budget {budget} exceeds the {order.shape[1]} prefixes available "
            f"from {depth_limit} depths x top-{k} tokens"
        )
    # Node index (1-based) of every candidate that was selected.
    node_of_candidate = torch.zeros(
        num_reqs, keys.shape[1] + 1, dtype=torch.long, device=device
    )
    node_ids = torch.arange(1, budget + 1, device=device).expand(num_reqs, budget)
    # Slot 0 of node_of_candidate stands for "parent is the root".
    node_of_candidate.scatter_(1, order + 1, node_ids)
    sel_parent_pos = torch.gather(parent_pos, 1, order)
    parents = torch.gather(node_of_candidate, 1, sel_parent_pos + 1)
    return DraftTrees(
        tokens=torch.gather(tokens, 1, order),
        parents=parents,
        depths=torch.gather(depth_of, 1, order),
        scores=torch.gather(scores, 1, order),
    )


def ancestor_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, max_depth: int
) -> torch.Tensor:
    """``[R, N, N]`` bool: ``mask[r, i, j]`` iff node ``j`` is node ``i`` or
    one of its ancestors, for ``i, j < num_nodes[r]`` (False elsewhere).

    ``parents`` is ``[R, N]`` including the root column (``-1``);
    ``max_depth`` bounds the depth of every node (at most the drafter's block
    depth), so the pointer chase is ``max_depth`` batched scatters, no sync.
    """
    num_reqs, n = parents.shape
    device = parents.device
    valid = torch.arange(n, device=device)[None, :] < num_nodes[:, None]
    mask = torch.eye(n, dtype=torch.int8, device=device).repeat(num_reqs, 1, 1)
    cur = torch.where(valid, parents, -1)
    for _ in range(max_depth):
        alive = cur >= 0
        mask.scatter_reduce_(
            2, cur.clamp(min=0)[:, :, None], alive[:, :, None].to(torch.int8), "amax"
        )
        cur = torch.where(alive, torch.gather(parents, 1, cur.clamp(min=0)), -1)
    return mask.bool() & valid[:, :, None] & valid[:, None, :]


@dataclass
class WalkResult:
    """Outcome of :func:`walk_trees` for ``R`` requests.

    ``path`` is ``[R, D + 1]``: the accepted node indices starting with the
    root (``path[:, 0] == 0``), padded with ``-1``. ``num_accepted`` counts the
    accepted *drafted* nodes (the path length minus the root). ``bonus`` is
    the target's token at the last accepted node, the next step's root.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    bonus: torch.Tensor


def walk_trees(
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor,
    target_tokens: torch.Tensor,
    max_depth: int,
) -> WalkResult:
    """Follow the target's own choices down each tree.

    Start at the root; while the target's token at the current node equals
    the token of one of its children, move to that child. Siblings never
    share a token (they are distinct top-k entries), so the move is unique.
    Every accepted token is the target's choice given its exact prefix, which
    makes the result lossless at any temperature.

    Args:
        node_tokens: ``[R, N]`` token of each node (the root column is
            ignored).
        parents: ``[R, N]`` parent node indices, ``-1`` for root / padding.
        num_nodes: ``[R]`` valid nodes per request, root included (>= 1).
        target_tokens: ``[R, N]`` the target's token (argmax or sample) at
            every node, i.e. its prediction for the node's successor.
        max_depth: bound on any node's depth; the walk takes that many steps.
    """
    num_reqs, n = node_tokens.shape
    device = node_tokens.device
    valid = torch.arange(n, device=device)[None, :] < num_nodes[:, None]
    # A column-0 parent index of -1 never matches a real node index.
    parents = torch.where(valid, parents, -2)
    cur = torch.zeros(num_reqs, dtype=torch.long, device=device)
    path = torch.full((num_reqs, max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    done = torch.zeros(num_reqs, dtype=torch.bool, device=device)
    node_ids = torch.arange(n, device=device)[None, :]
    for step in range(1, max_depth + 1):
        want = torch.gather(target_tokens, 1, cur[:, None])
        hit = (parents == cur[:, None]) & (node_tokens == want) & (node_ids > 0)
        found = hit.any(dim=1) & ~done
        nxt = torch.where(hit, node_ids, n).amin(dim=1)
        cur = torch.where(found, nxt, cur)
        path[:, step] = torch.where(found, nxt, -1)
        done = done | ~found
    num_accepted = (path[:, 1:] >= 0).sum(dim=1)
    bonus = torch.gather(target_tokens, 1, cur[:, None]).squeeze(1)
    return WalkResult(path=path, num_accepted=num_accepted, bonus=bonus)


def path_first_permutation(path: torch.Tensor, n: int) -> torch.Tensor:
    """``[R, n]`` permutation of node indices that puts the accepted path first.

    Row ``r`` lists ``path[r]`` (root, then the accepted nodes in depth
    order) followed by every other node in increasing index order. Gathering
    a request's per-node data (KV slots, hidden states) with it puts the
    accepted path exactly where a chain would have it, so the rest of the
    engine can treat the rejected nodes like a chain's rejected tail.
    """
    num_reqs = path.shape[0]
    device = path.device
    key = torch.arange(n, n + n, device=device).repeat(num_reqs, 1)
    depth = torch.arange(path.shape[1], device=device).expand_as(path)
    # Padding entries of ``path`` (-1) write the large key n to node 0,
    # which "amin" discards in favour of the root's depth 0.
    src = torch.where(path >= 0, depth, n)
    key.scatter_reduce_(1, path.clamp(min=0), src, "amin")
    return torch.sort(key, dim=1, stable=True).indices


def gather_tree_layout(
    tree_shapes: tuple[torch.Tensor, torch.Tensor] | None,
    tree_row: torch.Tensor,
    num_nodes: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parents, depths)``, ``[R, width]`` with the root in column 0, of the
    trees a verify batch checks, gathered from the proposal on the device.

    ``tree_shapes`` are a proposal's ``(parents, depths)`` (as in
    :class:`DraftTrees`). Row ``r`` verifies ``num_nodes[r]`` nodes (its root
    and a best-first prefix of its drafts, so a valid tree): those of
    proposal row ``tree_row[r]``, or, where that is ``-1`` (drafts not built
    as a tree), a chain. Columns past ``num_nodes[r]`` are padding: parent
    ``-1``, depth 0.
    """
    device = tree_row.device
    node = torch.arange(width, device=device)
    parents = (node - 1).expand(tree_row.shape[0], width)
    depths = node.expand(tree_row.shape[0], width)
    if tree_shapes is not None and width > 1:
        tree_parents, tree_depths = tree_shapes
        src = tree_row.clamp(min=0)
        root = torch.zeros_like(tree_row)[:, None]
        tree_parents = torch.cat([root - 1, tree_parents[src, : width - 1]], dim=1)
        tree_depths = torch.cat([root, tree_depths[src, : width - 1]], dim=1)
        built = (tree_row >= 0)[:, None]
        parents = torch.where(built, tree_parents.long(), parents)
        depths = torch.where(built, tree_depths.long(), depths)
    valid = node < num_nodes[:, None]
    return torch.where(valid, parents, -1), torch.where(valid, depths, 0)
