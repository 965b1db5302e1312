# SPDX-License-Identifier: Apache-2.0
"""Engine-free tests of the DDTree tensor cores against brute force."""

import heapq
import itertools

import pytest
import torch

from vllm_ddtree.v1.spec_decode.tree import (
    ancestor_mask,
    build_trees,
    gather_tree_layout,
    path_first_permutation,
    walk_trees,
)


def _random_topk(num_reqs, depth, vocab, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:
        # Few distinct values: many exact ties between prefixes.
        logits = torch.randint(0, 3, (num_reqs, depth, vocab), generator=g).float()
    else:
        logits = torch.randn(num_reqs, depth, vocab, generator=g) * 2
    logp = logits.log_softmax(-1)
    vals, ids = logp.sort(dim=-1, descending=True, stable=True)
    return logp, vals, ids


def _prefixes_of(tree, r):
    """Token tuples of every node of request r's tree (root excluded)."""
    tokens = tree.tokens[r].tolist()
    parents = tree.parents[r].tolist()
    out = []
    for j in range(len(tokens)):
        seq, node = [], j + 1
        while node > 0:
            seq.append(tokens[node - 1])
            node = parents[node - 1]
        out.append(tuple(reversed(seq)))
    return out


def _brute_force_scores(logp_r, depth):
    """Score of every prefix of length 1..depth."""
    vocab = logp_r.shape[-1]
    scores = {}
    for d in range(1, depth + 1):
        for seq in itertools.product(range(vocab), repeat=d):
            scores[seq] = sum(float(logp_r[i, t]) for i, t in enumerate(seq))
    return scores


def _heap_tree(vals_r, ids_r, budget):
    """The paper's best-first heap, written plainly (batch 1)."""
    depth = vals_r.shape[0]
    heap = [(-float(vals_r[0, 0]), (0,))]
    out = []
    while heap and len(out) < budget:
        neg, ranks = heapq.heappop(heap)
        out.append(tuple(int(ids_r[i, r]) for i, r in enumerate(ranks)))
        d = len(ranks) - 1
        if ranks[-1] + 1 < vals_r.shape[1]:
            sib = ranks[:-1] + (ranks[-1] + 1,)
            delta = float(vals_r[d, ranks[-1] + 1] - vals_r[d, ranks[-1]])
            heapq.heappush(heap, (neg - delta, sib))
        if d + 1 < depth:
            heapq.heappush(heap, (neg - float(vals_r[d + 1, 0]), ranks + (0,)))
    return out


@pytest.mark.parametrize("budget", [1, 2, 7, 30, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_matches_brute_force_and_heap(budget, seed):
    depth, vocab = 4, 6
    logp, vals, ids = _random_topk(3, depth, vocab, seed)
    tree = build_trees(vals, ids, budget)
    for r in range(3):
        got = _prefixes_of(tree, r)
        assert len(set(got)) == budget
        scores = _brute_force_scores(logp[r], depth)
        best = sorted(scores, key=lambda s: -scores[s])[:budget]
        assert set(got) == set(best)
        # Same nodes in the same (best-first) order as the heap.
        assert got == _heap_tree(vals[r], ids[r], budget)
        # Reported scores and depths agree with the prefixes.
        for j, seq in enumerate(got):
            assert tree.depths[r, j] == len(seq)
            assert tree.scores[r, j].item() == pytest.approx(scores[seq], abs=1e-4)


@pytest.mark.parametrize("budget", [5, 40])
def test_build_with_ties_is_prefix_closed_and_optimal(budget):
    depth, vocab = 3, 5
    logp, vals, ids = _random_topk(4, depth, vocab, seed=3, ties=True)
    tree = build_trees(vals, ids, budget)
    for r in range(4):
        got = _prefixes_of(tree, r)
        assert len(set(got)) == budget
        parents = tree.parents[r].tolist()
        assert all(p < j + 1 for j, p in enumerate(parents))
        # Every prefix of the node list is a tree (parents come first).
        seen = {0}
        for j, p in enumerate(parents):
            assert p in seen
            seen.add(j + 1)
        scores = _brute_force_scores(logp[r], depth)
        best = sorted(scores.values(), reverse=True)[:budget]
        mine = sorted((scores[s] for s in got), reverse=True)
        assert mine == pytest.approx(best, abs=1e-5)


def test_force_spine_keeps_top1_chain():
    depth, vocab, budget = 6, 8, 6
    g = torch.Generator().manual_seed(5)
    # Flat distributions deep down: the best tree is bushy and shallow.
    logits = torch.randn(1, depth, vocab, generator=g)
    logits[:, 0] *= 10
    logp = logits.log_softmax(-1)
    vals, ids = logp.sort(dim=-1, descending=True)
    spine = tuple(ids[0, :, 0].tolist())
    free = _prefixes_of(build_trees(vals, ids, budget), 0)
    assert spine not in free  # the test only means something if so
    forced = _prefixes_of(build_trees(vals, ids, budget, force_spine=True), 0)
    assert spine in forced
    assert len(set(forced)) == budget


def _random_tree(n, g):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return parents


def _random_parents(sizes, g):
    """``[len(sizes), max(sizes)]`` parents of random trees, ``-1`` padded."""
    parents = torch.full((len(sizes), max(sizes)), -1, dtype=torch.long)
    for r, n in enumerate(sizes):
        parents[r, :n] = torch.tensor(_random_tree(n, g))
    return parents


def _depths(parents):
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def test_ancestor_mask_random_trees():
    g = torch.Generator().manual_seed(0)
    sizes = [1, 2, 9, 17]
    n_max = max(sizes)
    parents = _random_parents(sizes, g)
    max_depth = max(max(_depths(parents[r, :n].tolist())) for r, n in enumerate(sizes))
    mask = ancestor_mask(parents, torch.tensor(sizes), max_depth)
    for r, n in enumerate(sizes):
        for i in range(n_max):
            anc = set()
            if i < n:
                node = i
                while node >= 0:
                    anc.add(node)
                    node = int(parents[r, node])
            for j in range(n_max):
                assert bool(mask[r, i, j]) == (j in anc)


def _reference_walk(tokens, parents, n, target):
    path, cur = [0], 0
    while True:
        nxt = [j for j in range(1, n) if parents[j] == cur and tokens[j] == target[cur]]
        if not nxt:
            return path, target[cur]
        cur = nxt[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(5))
def test_walk_and_permutation_match_reference(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 3, 16, 33, 65]
    n_max = max(sizes)
    vocab = 3  # tiny vocab: long accepted paths happen often
    tokens = torch.randint(0, vocab, (len(sizes), n_max), generator=g)
    parents = torch.full((len(sizes), n_max), -1, dtype=torch.long)
    for r, n in enumerate(sizes):
        par = _random_tree(n, g)
        # Siblings carry distinct tokens, as top-k children do.
        for j in range(1, n):
            used = {int(tokens[r, s]) for s in range(1, j) if par[s] == par[j]}
            free = [t for t in range(n_max + vocab) if t not in used]
            tokens[r, j] = free[
                int(torch.randint(0, min(len(free), vocab), (1,), generator=g))
            ]
        parents[r, :n] = torch.tensor(par)
    target = torch.randint(0, vocab, (len(sizes), n_max), generator=g)
    max_depth = max(max(_depths(parents[r, :n].tolist())) for r, n in enumerate(sizes))
    res = walk_trees(tokens, parents, torch.tensor(sizes), target, max_depth)
    perm = path_first_permutation(res.path, n_max)
    for r, n in enumerate(sizes):
        path, bonus = _reference_walk(
            tokens[r].tolist(), parents[r].tolist(), n, target[r].tolist()
        )
        got = [p for p in res.path[r].tolist() if p >= 0]
        assert got == path
        assert int(res.num_accepted[r]) == len(path) - 1
        assert int(res.bonus[r]) == bonus
        rest = [j for j in range(n_max) if j not in path]
        assert perm[r].tolist() == path + rest


def test_packed_mask_round_trips():
    from vllm_ddtree.v1.attention.backends.tree_attn import pack_ancestor_mask
    from vllm_ddtree.v1.attention.ops.tree_attention_ref import unpack_tree_mask

    g = torch.Generator().manual_seed(1)
    sizes = [1, 5, 33, 70]
    n_max = max(sizes)
    parents = _random_parents(sizes, g)
    mask = ancestor_mask(parents, torch.tensor(sizes), n_max)
    packed, row_start = pack_ancestor_mask(mask, sizes)
    assert packed.dtype == torch.int32 and packed.shape == (sum(sizes), 3)
    bits = unpack_tree_mask(packed, n_max)
    for r, n in enumerate(sizes):
        rows = bits[int(row_start[r]) : int(row_start[r]) + n]
        assert torch.equal(rows.bool(), mask[r, :n])


def test_tree_info_packs_masks_from_the_running_node_count():
    """A published tree's packed masks (the kernel's form) start request
    ``r``'s rows at the running sum of the node counts before it, which
    :class:`TreeAttentionInfo` derives from its device tensor, as int32."""
    from vllm_ddtree.v1.attention.backends.tree_attn import (
        TreeAttentionInfo,
        pack_ancestor_mask,
    )

    sizes = [3, 1, 40, 6]
    parents = _random_parents(sizes, torch.Generator().manual_seed(2))
    info = TreeAttentionInfo(
        req_rows=torch.arange(4, dtype=torch.int32),
        q_start=torch.zeros(4, dtype=torch.int32),
        num_nodes=torch.tensor(sizes, dtype=torch.int32),
        ctx_len=torch.zeros(4, dtype=torch.int32),
        parents=parents,
        max_depth=max(sizes),
        req_rows_cpu=[0, 1, 2, 3],
        q_start_cpu=[0] * 4,
        num_nodes_cpu=sizes,
        ctx_len_cpu=[0] * 4,
    )
    packed, starts = info.packed_mask
    want, want_starts = pack_ancestor_mask(
        ancestor_mask(parents, torch.tensor(sizes), max(sizes)), sizes
    )
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 3, 4, 44]
    assert torch.equal(starts, want_starts)
    assert torch.equal(packed, want)


def test_gather_tree_layout_rows_prefixes_and_chains():
    """Each verify row gets its proposal row's best-first prefix (root in
    column 0), rows without a built tree a chain, and padding past the
    row's nodes (-1, 0)."""
    _, values, tokens = _random_topk(3, 4, 6, seed=5)
    trees = build_trees(values, tokens, budget=7)
    # Verify rows: proposal row 2 (all 8 nodes), row 0 cut to 3 nodes, a
    # chain of 4 nodes, a row without drafts, proposal row 1 cut to 5 nodes.
    tree_row = torch.tensor([2, 0, -1, -1, 1])
    num_nodes = torch.tensor([8, 3, 4, 1, 5])
    shapes = (trees.parents, trees.depths)
    parents, depths = gather_tree_layout(shapes, tree_row, num_nodes, 8)
    rows = zip(tree_row.tolist(), num_nodes.tolist(), strict=True)
    for r, (src, n) in enumerate(rows):
        if src >= 0:
            want_p = [-1, *trees.parents[src, : n - 1].tolist()]
            want_d = [0, *trees.depths[src, : n - 1].tolist()]
        else:
            want_p, want_d = list(range(-1, n - 1)), list(range(n))
        assert parents[r].tolist() == want_p + [-1] * (8 - n), r
        assert depths[r].tolist() == want_d + [0] * (8 - n), r
        # A best-first prefix is a tree: every parent precedes its node.
        assert all(want_p[i] < i for i in range(n))
    # Without a proposal every row is a chain.
    parents, depths = gather_tree_layout(None, tree_row, num_nodes, 8)
    assert parents[0].tolist() == list(range(-1, 7))
    assert depths[1].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
