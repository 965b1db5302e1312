# SPDX-License-Identifier: Apache-2.0
"""The one-launch Triton tree cores on a CUDA GPU equal the torch cores.

Same cases as the interpreted CPU tests (``tests/test_triton_tree_cores.py``,
``tests/test_triton_verify_step.py``) plus full-size ones: 64 requests,
budgets up to 256, ties.

Run on the device machine: ``python -m pytest tests/gpu/test_tree_cores_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_triton_tree_cores import (
    BUILD_CASES,
    CASES,
    gathered_walk_equal,
    random_batch,
    random_topk,
)
from tests.test_triton_verify_step import CASES as VERIFY_STEP_CASES
from tests.test_triton_verify_step import (
    CHAIN_ROWS_UPTO,
    UNIFORM_CASES,
    committed_rows,
    compare_uniform,
)
from tests.test_triton_verify_step import compare as compare_verify_step
from vllm_ddtree.v1.attention.backends.tree_attn import pack_ancestor_mask
from vllm_ddtree.v1.spec_decode.tree import ancestor_mask, build_trees, walk_trees

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WALK_CASES = {**CASES, "batch-64": (64, 65, 15, 11), "batch-64-b256": (64, 257, 15, 12)}
GPU_BUILD_CASES = {
    **BUILD_CASES,
    "build-batch-64": (64, 15, 64, 64, False, False, 13),
    "build-b256-ties": (8, 15, 256, 256, True, True, 14),
}


def _walk_case(name: str):
    """A walk case's batch on the GPU and the torch walk of it."""
    num_reqs, width, max_depth, seed = WALK_CASES[name]
    batch = [t.cuda() for t in random_batch(num_reqs, width, max_depth, seed)]
    return *batch, walk_trees(*batch, max_depth)


@pytest.mark.parametrize("name", list(WALK_CASES))
def test_walk_and_mask_on_gpu(name):
    from vllm_ddtree.v1.ops.triton_tree_cores import (
        packed_ancestor_mask_triton,
        walk_trees_triton,
    )

    num_reqs, width, max_depth, seed = WALK_CASES[name]
    tokens, parents, num_nodes, target, ref = _walk_case(name)
    out = torch.full((num_reqs, width + 1), -7, dtype=torch.int32, device="cuda")
    got = walk_trees_triton(tokens, parents, num_nodes, target, max_depth, out)
    assert torch.equal(got.path, ref.path)
    assert torch.equal(got.num_accepted, ref.num_accepted)
    assert torch.equal(got.bonus, ref.bonus)
    for r in range(num_reqs):
        k = int(ref.num_accepted[r])
        assert out[r, :k].tolist() == tokens[r, ref.path[r, 1 : k + 1]].tolist()
        assert int(out[r, k]) == int(ref.bonus[r])
        assert (out[r, k + 1 :] == -7).all()
    assert gathered_walk_equal(
        tokens, parents, num_nodes, target, max_depth, ref, out, seed
    )

    counts = num_nodes.tolist()
    want, starts = pack_ancestor_mask(
        ancestor_mask(parents, num_nodes, max_depth), counts
    )
    got_mask = packed_ancestor_mask_triton(
        parents, num_nodes, starts, sum(counts), max_depth
    )
    assert torch.equal(got_mask, want)


@pytest.mark.parametrize("name", ["batch-64", "batch-64-b256"])
# One block of columns, and two (rows wider than the commit's 4096-column
# block).
@pytest.mark.parametrize("row_width", [2048, 4096 + 24])
def test_walk_commits_kv_on_gpu(name, row_width):
    """The V2 walk's launch with the KV commit: every layer's accepted paths
    moved as the commit's definition says, the walk itself unchanged."""
    from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit
    from vllm_ddtree.v1.ops.triton_tree_cores import (
        PathFirstOrder,
        walk_trees_triton,
    )

    num_reqs, width, max_depth, seed = WALK_CASES[name]
    tokens, parents, num_nodes, target, ref = _walk_case(name)
    num_tokens = num_reqs * width
    roots = torch.arange(0, num_tokens, width, device="cuda")
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_tokens + 7, generator=g)[:num_tokens]
    layers = [
        torch.randn(num_tokens + 7, row_width, generator=g).to(torch.bfloat16)
        for _ in range(3)
    ]
    expected = committed_rows(layers, slots, roots, ref.path)
    got_layers = [rows.cuda() for rows in layers]
    got = walk_trees_triton(
        tokens,
        parents,
        num_nodes,
        target,
        max_depth,
        path_first=PathFirstOrder(roots, torch.arange(num_tokens, device="cuda"), None),
        kv_commit=(SlotRowsCommit.for_rows(got_layers), slots.cuda()),
    )
    assert torch.equal(got.path, ref.path)
    assert torch.equal(got.bonus, ref.bonus)
    assert not torch.equal(expected[0], layers[0])
    for got_rows, want in zip(got_layers, expected, strict=True):
        assert torch.equal(got_rows.cpu(), want)


@pytest.mark.parametrize("name", list(GPU_BUILD_CASES))
def test_build_on_gpu(name):
    from vllm_ddtree.v1.ops.triton_tree_cores import build_trees_triton

    num_reqs, depths, k, budget, spine, ties, seed = GPU_BUILD_CASES[name]
    values, tokens = (t.cuda() for t in random_topk(num_reqs, depths, k, ties, seed))
    ref = build_trees(values, tokens, budget, spine)
    got = build_trees_triton(values, tokens, budget, spine)
    assert got is not None
    for field in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field


@pytest.mark.parametrize("name", list(VERIFY_STEP_CASES))
def test_verify_step_kernels_on_gpu(name):
    rec = compare_verify_step(name, "cuda")
    assert rec["parents_equal"] and rec["positions_equal"], rec
    assert all(rec["rows_equal"].values()), rec
    assert rec["mask_equal"] and rec["mask_aligned"], rec
    assert rec["order_equal"] and rec["restored"], rec
    assert rec["commit_kernel_equal"] and rec["commit_torch_equal"], rec
    assert rec["chain_rows"] is (True if name in CHAIN_ROWS_UPTO else None), rec
    assert rec["lean_layout"], rec


@pytest.mark.parametrize("name", list(UNIFORM_CASES))
def test_lay_out_fills_uniform_buffers_on_gpu(name):
    rec = compare_uniform(name, "cuda")
    assert rec["mask_equal"] and rec["ctx_equal"] and rec["parents_equal"], rec
    assert rec["fill_skipped"] and rec["same_description"], rec


@pytest.mark.parametrize(
    ("rows", "vocab", "dtype"),
    [
        (15, 151936, torch.bfloat16),
        (960, 151936, torch.bfloat16),
        (15, 8192, torch.float16),
    ],
)
def test_draft_topk_on_gpu(rows, vocab, dtype):
    """The drafter's top-k on a GPU (top logits minus a one-pass
    logsumexp) equals torch's log-softmax top-k at real vocabulary sizes."""
    from vllm_ddtree.v1.spec_decode.ddtree_proposer import draft_topk

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (4 * torch.randn(rows, vocab, device="cuda", generator=g)).to(dtype)
    want_values, _ = logits.float().log_softmax(dim=-1).topk(64, dim=-1)
    values, tokens = draft_topk(logits, 64)
    picked = logits.float().log_softmax(dim=-1).gather(1, tokens)
    torch.testing.assert_close(values, want_values, rtol=0, atol=1e-4)
    torch.testing.assert_close(values, picked, rtol=0, atol=1e-4)
