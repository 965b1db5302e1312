# SPDX-License-Identifier: Apache-2.0
"""The one-launch Triton tree cores equal the torch cores (CPU, interpreted).

Like ``test_triton_tree_attention.py``, the kernels run under
``TRITON_INTERPRET=1`` in one subprocess (this file with ``--worker``), which
prints one JSON line per case. The torch cores of
:mod:`vllm_ddtree.v1.spec_decode.tree` are the oracle; they are tested on
their own in ``test_tree.py``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.utils import interpreted_case, interpreter_fixture, print_case, run_case

# name -> (requests, max nodes incl. root, max depth, seed)
CASES: dict[str, tuple[int, int, int, int]] = {
    "single-root": (1, 1, 15, 0),
    "one-node": (2, 2, 1, 1),
    "small": (3, 9, 4, 2),
    "word-edge": (4, 33, 15, 3),
    "budget-64": (5, 65, 15, 4),
    "budget-256": (2, 257, 15, 5),
}


def random_batch(num_reqs: int, width: int, max_depth: int, seed: int):
    """Padded trees (parents in topological order, depth <= max_depth), node
    tokens with distinct siblings, and target tokens that follow a random
    child most of the time so that walks go deep."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((num_reqs, width), -1, dtype=torch.long)
    tokens = torch.full((num_reqs, width), -1, dtype=torch.long)
    target = torch.zeros(num_reqs, width, dtype=torch.long)
    num_nodes = torch.randint(1, width + 1, (num_reqs,), generator=g)
    num_nodes[0] = width
    for r in range(num_reqs):
        n = int(num_nodes[r])
        depth = [0]
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            allowed = [j for j in range(i) if depth[j] < max_depth]
            p = allowed[int(torch.randint(0, len(allowed), (1,), generator=g))]
            parents[r, i] = p
            depth.append(depth[p] + 1)
            children[p].append(i)
            # Distinct among siblings: token = 100 * sibling rank + noise.
            tokens[r, i] = 100 * len(children[p]) + int(
                torch.randint(0, 7, (1,), generator=g)
            )
        for i in range(n):
            kids = children[i]
            if kids and torch.rand(1, generator=g).item() < 0.8:
                pick = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
                target[r, i] = tokens[r, pick]
            else:
                target[r, i] = 9999
    return tokens, parents, num_nodes, target


# name -> (requests, depths, top-k, budget, force_spine, tie-heavy, seed)
BUILD_CASES: dict[str, tuple[int, int, int, int, bool, bool, int]] = {
    "build-b1": (2, 15, 1, 1, False, False, 0),
    "build-b8": (3, 15, 8, 8, False, False, 1),
    "build-b8-spine": (3, 15, 8, 8, True, False, 2),
    "build-ties": (4, 6, 6, 24, False, True, 3),
    "build-ties-spine": (4, 6, 6, 24, True, True, 4),
    "build-narrow-vocab": (2, 15, 5, 64, False, False, 5),
    "build-b64": (2, 15, 64, 64, False, False, 6),
    # The non-spine pair table's cross-depth bound (a child never passes its
    # parent) where keys tie across depths: log-probabilities of 0 included.
    "build-b64-ties": (3, 15, 64, 64, False, True, 9),
    "build-b64-spine": (2, 15, 64, 64, True, False, 7),
    "build-b128": (1, 15, 128, 128, True, False, 8),
}


def random_topk(num_reqs: int, depths: int, k: int, ties: bool, seed: int):
    """Sorted per-depth top-k log-probabilities (optionally coarse, so that
    many sums tie exactly, within and across depths) and distinct token ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depths, 4 * k + 8, generator=g) * 2
    if ties:
        logits = logits.round()
    logprobs = logits.log_softmax(-1)
    if ties:
        logprobs = (logprobs * 4).round() / 4  # exact in float32
    values, tokens = logprobs.topk(k, dim=-1)
    if ties:
        # Every third depth's best token is certain: its children's keys
        # equal their parents' exactly.
        values[:, ::3, 0] = 0.0
    return values, tokens


def gathered_walk_equal(
    tokens, parents, num_nodes, target, max_depth, ref, expected_out, seed
) -> bool:
    """The walk in the samplers' form (int32 tokens and int64 choices in flat
    rows, read through two different row maps) equals ``ref`` and writes
    ``expected_out``; on the batch's device."""
    from vllm_ddtree.v1.ops.triton_tree_cores import walk_trees_triton

    num_reqs, width = tokens.shape
    g = torch.Generator().manual_seed(seed)
    maps = [
        torch.randperm(num_reqs * width, generator=g).view(num_reqs, width)
        for _ in range(2)
    ]
    maps = [m.to(tokens.device) for m in maps]
    flat_tokens = tokens.new_empty(num_reqs * width, dtype=torch.int32)
    flat_tokens[maps[0]] = tokens.int()
    flat_target = target.new_empty(num_reqs * width)
    flat_target[maps[1]] = target
    out = torch.full_like(expected_out, -7)
    got = walk_trees_triton(
        flat_tokens,
        parents,
        num_nodes,
        flat_target,
        max_depth,
        out,
        token_rows=maps[0],
        target_rows=maps[1],
    )
    return (
        torch.equal(got.path, ref.path)
        and torch.equal(got.num_accepted, ref.num_accepted)
        and torch.equal(got.bonus, ref.bonus)
        and torch.equal(out, expected_out)
    )


def _worker() -> None:
    try:
        import triton  # noqa: F401

        from vllm_ddtree.v1.attention.backends.tree_attn import pack_ancestor_mask
        from vllm_ddtree.v1.ops.triton_tree_cores import (
            build_trees_triton,
            packed_ancestor_mask_triton,
            walk_trees_triton,
        )
        from vllm_ddtree.v1.spec_decode.tree import (
            ancestor_mask,
            build_trees,
            walk_trees,
        )
    except Exception as exc:  # pragma: no cover - environment dependent
        print("SKIP " + json.dumps(f"cannot import triton: {exc!r}"))
        return
    for name, (num_reqs, width, max_depth, seed) in CASES.items():
        tokens, parents, num_nodes, target = random_batch(
            num_reqs, width, max_depth, seed
        )
        res: dict = {}
        try:
            ref = walk_trees(tokens, parents, num_nodes, target, max_depth)
            out = torch.full((num_reqs, width + 1), -7, dtype=torch.int32)
            got = walk_trees_triton(tokens, parents, num_nodes, target, max_depth, out)
            expected_out = torch.full_like(out, -7)
            for r in range(num_reqs):
                k = int(ref.num_accepted[r])
                path = ref.path[r, 1 : k + 1]
                expected_out[r, :k] = tokens[r, path].int()
                expected_out[r, k] = int(ref.bonus[r])
            res["walk_equal"] = (
                torch.equal(got.path, ref.path)
                and torch.equal(got.num_accepted, ref.num_accepted)
                and torch.equal(got.bonus, ref.bonus)
            )
            res["out_equal"] = torch.equal(out, expected_out)
            res["max_accepted"] = int(ref.num_accepted.max())
            res["gather_equal"] = gathered_walk_equal(
                tokens, parents, num_nodes, target, max_depth, ref, expected_out, seed
            )

            counts = num_nodes.tolist()
            want, starts = pack_ancestor_mask(
                ancestor_mask(parents, num_nodes, max_depth), counts
            )
            bits = packed_ancestor_mask_triton(
                parents, num_nodes, starts, sum(counts), max_depth
            )
            res["mask_equal"] = torch.equal(bits, want)
            # Into a given buffer (the uniform batches' graph buffer).
            out = torch.full_like(want, -1)
            into = packed_ancestor_mask_triton(
                parents, num_nodes, starts, sum(counts), max_depth, out=out
            )
            res["mask_out_equal"] = into is out and torch.equal(out, want)
        except Exception as exc:
            res = {"error": repr(exc)}
        print_case(name, res)
    for name, (num_reqs, depths, k, budget, spine, ties, seed) in BUILD_CASES.items():
        values, tokens = random_topk(num_reqs, depths, k, ties, seed)
        try:
            ref = build_trees(values, tokens, budget, spine)
            got = build_trees_triton(values, tokens, budget, spine)
            res = {
                "fields_equal": {
                    f: torch.equal(getattr(got, f), getattr(ref, f))
                    for f in ("tokens", "parents", "depths", "scores")
                }
            }
        except Exception as exc:
            res = {"error": repr(exc)}
        print_case(name, res)
    _worker_compile_variants()


def _worker_compile_variants() -> None:
    """The start-up warm-ups launch cleanly: the cores for a budget whose
    trees span two node tiles, and the tree attention over every query tile."""
    from vllm_ddtree.v1.attention.ops.triton_tree_attention import (
        compile_variants as attention_variants,
    )
    from vllm_ddtree.v1.ops.triton_tree_cores import compile_variants

    cache = torch.zeros(4, 16, 2, 16)

    def both() -> dict:
        walks = compile_variants(
            torch.device("cpu"),
            budget=64,
            max_depth=15,
            top_k=8,
            force_spine=True,
            out_dtype=torch.int64,
            v2_runner=True,
        )
        # Block 0 for every position of the warm-up rows (context 32 + nodes).
        block_table = torch.zeros(1, 19, dtype=torch.int32)
        ran = attention_variants(cache, cache, block_table, 4, max_nodes=260)
        return {"attention_variants": sorted(ran), "walk_variants": walks}

    def one_block() -> dict:
        # A one-block table whose row is followed by block ids no cache has
        # (a hybrid model's long pages at max_num_seqs=1, on a GPU).
        table = torch.tensor([[0, 1 << 20, 1 << 20]], dtype=torch.int32)[:, :1]
        ran = attention_variants(cache, cache, table, 4, max_nodes=8)
        return {"attention_variants": sorted(ran)}

    run_case("compile-variants", both)
    # Last: a read past the table would crash the worker (a segfault under
    # the interpreter, an illegal address on a GPU).
    run_case("compile-variants-one-block", one_block)


interp_results = interpreter_fixture(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_tree_cores_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert rec["walk_equal"], rec
    assert rec["out_equal"], rec
    assert rec["gather_equal"], rec
    assert rec["mask_equal"], rec
    assert rec["mask_out_equal"], rec


@pytest.mark.parametrize("name", list(BUILD_CASES))
def test_triton_tree_build_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert all(rec["fields_equal"].values()), rec


def test_compile_variants_interpreted(interp_results):
    rec = interpreted_case(interp_results, "compile-variants")
    # 2 q heads per KV head, up to 260 nodes (520 rows): tiles of up to 64
    # rows through 512 rows, wide tiles past them.
    tiles = [16, 32, 64, 256]
    assert rec["attention_variants"] == [[m, s] for m in tiles for s in (False, True)]
    # (node tile, depth tile): trees (depth 15) in both node tiles, and rows
    # verified as chains, whose depth bound is their width - 1 (up to 64).
    assert rec["walk_variants"] == [[64, 16], [64, 32], [64, 64], [128, 16], [128, 128]]


def test_compile_variants_one_block_interpreted(interp_results):
    """The warm-up's context and tree fit a block table of one block."""
    rec = interpreted_case(interp_results, "compile-variants-one-block")
    assert rec["attention_variants"] == [[16, False], [16, True]]


def test_tie_heavy_inputs_tie():
    """The tie cases really contain equal path scores (stable order matters)."""
    values, _ = random_topk(*BUILD_CASES["build-ties"][:3], True, 3)
    sums = (values[:, 0, :, None] + values[:, 1, None, :]).flatten(1)
    assert any(len(set(row.tolist())) < row.numel() for row in sums)


def test_random_batches_walk_deep():
    """The cases exercise multi-token acceptance, not just root-only walks."""
    from vllm_ddtree.v1.spec_decode.tree import walk_trees

    tokens, parents, num_nodes, target = random_batch(*CASES["budget-64"])
    walk = walk_trees(tokens, parents, num_nodes, target, CASES["budget-64"][2])
    assert int(walk.num_accepted.max()) >= 3


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
