# SPDX-License-Identifier: Apache-2.0
"""Uniform tree batches (the full-CUDA-graph shape): the builder's fixed
buffers describe the same trees as the runner's per-step metadata, keep
their addresses from step to step, and give the same attention."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.v1.attention.backends.tree_attn import (
    PagedKVLayout,
    TreeAttentionInfo,
    UniformTreeBuffers,
    pack_ancestor_mask,
    torch_tree_attention,
)

N = 7  # nodes per tree (1 + num_speculative_tokens)
PAGE = 4


def _random_parents(num_reqs: int, gen: torch.Generator) -> torch.Tensor:
    parents = torch.full((num_reqs, N), -1, dtype=torch.int64)
    for i in range(1, N):
        parents[:, i] = torch.randint(0, i, (num_reqs,), generator=gen)
    return parents


def _depth_bound(parents: torch.Tensor) -> int:
    depth = torch.zeros_like(parents)
    for i in range(1, N):
        depth[:, i] = depth.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    return int(depth.max())


def _published(
    parents: torch.Tensor, ctx: list[int], rows: list[int] | None = None
) -> TreeAttentionInfo:
    """The runner's per-step metadata for trees at batch ``rows`` (default:
    a batch made of these trees), each of those requests' context in
    ``ctx``."""
    num_reqs = parents.shape[0]
    rows = list(range(num_reqs)) if rows is None else rows
    q_start = [r * N for r in rows]
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return TreeAttentionInfo(
        req_rows=as_i32(rows),
        q_start=as_i32(q_start),
        num_nodes=as_i32([N] * num_reqs),
        ctx_len=as_i32(ctx),
        parents=parents,
        max_depth=_depth_bound(parents),
        req_rows_cpu=rows,
        q_start_cpu=q_start,
        num_nodes_cpu=[N] * num_reqs,
        ctx_len_cpu=ctx,
        covers_batch=rows == list(range(len(ctx))),
    )


def _seq_lens(ctx: list[int], padding: int) -> torch.Tensor:
    # vLLM's padded graph rows have empty queries and zero lengths.
    return torch.tensor([c + N for c in ctx] + [0] * padding, dtype=torch.int32)


def test_matches_uniform_batches_only():
    buffers = UniformTreeBuffers(4, N, 64, torch.device("cpu"))

    def offsets(*lens: int) -> torch.Tensor:
        return torch.tensor([0, *lens]).cumsum(0)

    assert buffers.matches(offsets(N, N, N))
    assert buffers.matches(offsets(N, N, 0, 0))  # graph padding
    assert not buffers.matches(offsets(N, 1))  # a plain decode next to a tree
    assert not buffers.matches(offsets(N - 1, N - 1))  # adaptive cut trees
    assert not buffers.matches(offsets(N, 2 * N))  # a prefill chunk
    assert not buffers.matches(offsets(*[N] * 5))  # more rows than buffers
    assert not buffers.matches(offsets())


def test_fill_matches_runner_metadata_and_keeps_addresses():
    gen = torch.Generator().manual_seed(0)
    buffers = UniformTreeBuffers(5, N, 64, torch.device("cpu"))
    addresses = [t.data_ptr() for t in (buffers.mask, buffers.ctx_len)]
    for step in range(3):
        parents = _random_parents(3, gen)
        ctx = torch.randint(0, 40, (3,), generator=gen).tolist()
        tree = _published(parents, ctx)
        info = buffers.fill(5, _seq_lens(ctx, padding=2), tree)
        assert [t.data_ptr() for t in (buffers.mask, buffers.ctx_len)] == addresses
        assert info.ctx_len.tolist() == ctx + [0, 0], step
        assert info.q_start.tolist() == [r * N for r in range(5)]
        assert info.num_nodes.tolist() == [N] * 5
        assert info.max_nodes == N and info.max_ctx_len == 64 and info.covers_batch
        packed, starts = info.packed_mask
        expected, expected_starts = tree.packed_mask
        assert torch.equal(packed[: 3 * N], expected)
        assert torch.equal(starts[:3], expected_starts)
        # Padding rows still see themselves (finite, discarded outputs).
        node = torch.arange(N).repeat(2)
        bits = (packed[3 * N :, 0] >> node) & 1
        assert bits.eq(1).all()


def test_fill_puts_request_rs_masks_at_row_r_times_n():
    """The buffers hold request ``r``'s masks at rows ``r * N``: the
    published trees' masks (their rows are the batch's first requests, in
    order), whatever the buffers held before; padding rows keep theirs."""
    tree = _published(_random_parents(3, torch.Generator().manual_seed(1)), [1, 2, 3])
    want, starts = tree.packed_mask
    buffers = UniformTreeBuffers(4, N, 64, torch.device("cpu"))
    buffers.mask.fill_(-1)
    info = buffers.fill(4, _seq_lens([1, 2, 3], 1), tree)
    assert torch.equal(info.packed_mask[0][: 3 * N], want)
    assert torch.equal(info.packed_mask[1][:3], starts)
    assert bool((buffers.mask[3 * N :] == -1).all())


def test_fill_without_a_tree_is_causal():
    buffers = UniformTreeBuffers(3, N, 64, torch.device("cpu"))
    buffers.fill(
        2,
        _seq_lens([5, 9], 0),
        _published(_random_parents(2, torch.Generator()), [5, 9]),
    )
    info = buffers.fill(2, _seq_lens([5, 9], 0), None)
    causal = torch.ones(N, N, dtype=torch.bool).tril().expand(2, N, N)
    expected, _ = pack_ancestor_mask(causal, [N, N])
    assert torch.equal(info.packed_mask[0], expected)
    assert info.parents[0].tolist() == list(range(-1, N - 1))


def test_fill_rejects_trees_of_another_size():
    buffers = UniformTreeBuffers(3, N, 64, torch.device("cpu"))
    tree = _published(_random_parents(2, torch.Generator()), [5, 9])
    tree.num_nodes_cpu = [N, N - 2]
    with pytest.raises(ValueError, match=f"must have {N} nodes each"):
        buffers.fill(2, _seq_lens([5, 9], 0), tree)


def test_fill_puts_trees_beside_n_token_prompts_at_their_rows():
    """A prompt (or prefill chunk) of exactly ``N`` tokens beside trees still
    makes a uniform batch (the 2026-12-04 H200 soak's engine died on one):
    its rows are chains, the trees' masks land at their own rows, whatever
    the buffers held before."""
    gen = torch.Generator().manual_seed(2)
    parents = _random_parents(2, gen)
    buffers = UniformTreeBuffers(5, N, 64, torch.device("cpu"))
    buffers.mask.fill_(-1)
    for rows in ([1, 3], [2, 0], [1, 0]):
        tree = _published(parents, [5, 9], rows)
        info = buffers.fill(4, _seq_lens([0, 5, 7, 9], 0), tree)
        assert info.covers_batch and info.max_depth == N - 1
        chain, _ = pack_ancestor_mask(
            torch.ones(N, N, dtype=torch.bool).tril()[None], [N]
        )
        want, _ = tree.packed_mask
        packed = info.packed_mask[0].view(4, N, -1)
        for r in range(4):
            expected = want.view(2, N, -1)[rows.index(r)] if r in rows else chain
            assert torch.equal(packed[r], expected), (rows, r)
            expected = parents[rows.index(r)] if r in rows else torch.arange(N) - 1
            assert info.parents[r].tolist() == expected.tolist(), (rows, r)
        assert bool((buffers.mask[4 * N :] == -1).all())


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("tree_rows", [None, [2, 0]])
def test_uniform_metadata_gives_the_same_attention(seed, tree_rows):
    """Same attention as the runner's metadata; with ``tree_rows``, only
    those requests are trees and the rest ``N``-token prompts, whose
    reference is a chain tree (causal attention)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, heads, kv_heads, dim = 3, 4, 2, 8
    ctx = torch.randint(0, 30, (num_reqs,), generator=gen).tolist()
    blocks_per_req = (max(ctx) + N + PAGE - 1) // PAGE
    num_blocks = num_reqs * blocks_per_req + 1
    kv = torch.randn(num_blocks, 2, PAGE, kv_heads, dim, generator=gen)
    layout = PagedKVLayout.from_strides(kv[:, 0], kv[:, 1])
    block_table = 1 + torch.randperm(num_blocks - 1, generator=gen)
    block_table = block_table.view(num_reqs, blocks_per_req).to(torch.int32)
    tokens = num_reqs * N
    query = torch.randn(tokens, heads, dim, generator=gen)
    key = torch.randn(tokens, kv_heads, dim, generator=gen)
    value = torch.randn(tokens, kv_heads, dim, generator=gen)
    parents = _random_parents(num_reqs, gen)
    tree = _published(parents, ctx)
    uniform = UniformTreeBuffers(4, N, blocks_per_req * PAGE, torch.device("cpu"))
    published = tree
    if tree_rows is not None:
        prompts = [r for r in range(num_reqs) if r not in tree_rows]
        parents[prompts] = torch.arange(N) - 1
        tree = _published(parents, ctx)
        published = _published(
            parents[tree_rows], [ctx[r] for r in tree_rows], tree_rows
        )
    info = uniform.fill(num_reqs, _seq_lens(ctx, 0), published)

    outs = []
    for meta in (tree, info):
        out = torch.full_like(query, float("nan"))
        torch_tree_attention(
            query, key, value, kv, layout, block_table, meta, 0.3, out
        )  # fmt: skip
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[1], outs[0])


def test_flash_builder_attaches_uniform_or_published_trees():
    """The GPU builder's glue: uniform batches get the buffers (and vLLM's
    own block table, rows in order) and, with ``ddtree.flash_context``, the
    FlashAttention-context path; other batches the published tree with its
    rows' block-table rows and the fused kernel."""
    from types import SimpleNamespace

    from vllm_ddtree.v1.attention.backends.flash_tree_attn import (
        FlashTreeAttentionMetadataBuilder,
    )

    builder = FlashTreeAttentionMetadataBuilder.__new__(
        FlashTreeAttentionMetadataBuilder
    )
    builder.uniform_trees = {N: UniformTreeBuffers(4, N, 64, torch.device("cpu"))}
    builder.flash_context = True
    tree = _published(_random_parents(2, torch.Generator()), [5, 9])
    block_table = torch.arange(8, dtype=torch.int32).view(2, 4)

    def attach(query_lens: list[int]):
        metadata = SimpleNamespace(block_table=block_table)
        cm = SimpleNamespace(
            causal=True,
            query_start_loc_cpu=torch.tensor([0, *query_lens]).cumsum(0),
            num_reqs=len(query_lens),
            seq_lens=_seq_lens([5, 9], 0),
        )
        builder._attach_tree(metadata, cm, tree, builder._uniform_buffers(cm))
        return metadata

    uniform = attach([N, N])
    assert uniform.tree.packed is not None and uniform.tree.ctx_len_bound == 64
    assert uniform.tree_block_table is block_table
    assert uniform.tree_flash_context
    mixed = attach([N, 3])
    assert mixed.tree is tree
    # The trees are the batch's rows in order: its own table, no gather.
    assert mixed.tree_block_table is block_table
    assert not getattr(mixed, "tree_flash_context", False)
    tree = _published(_random_parents(1, torch.Generator()), [9], rows=[1])
    second = attach([3, N])
    assert second.tree is tree
    assert second.tree_block_table.tolist() == [block_table[1].tolist()]


def test_builder_plans_no_stock_pass_for_batches_the_trees_cover():
    """A batch whose rows are all tree rows (a uniform batch's buffers, or
    a published tree that covers it: decode steps, prompts as chain rows)
    runs no stock kernel, so the stock builder is asked for no extras
    (``fast_build``: no FlashAttention 3 ahead-of-time schedule; no cascade
    prefix); any other batch gets the caller's arguments. With
    ``ddtree.flash_context`` a uniform batch runs FlashAttention over its
    context and keeps them."""
    from types import SimpleNamespace

    from vllm_ddtree.v1.attention.backends.flash_tree_attn import (
        FlashTreeAttentionMetadataBuilder,
    )
    from vllm_ddtree.v1.attention.backends.tree_attn import (
        TreeMetadataBuilderMixin,
        publish_tree,
    )

    block_table = torch.arange(8, dtype=torch.int32).view(2, 4)

    class StockBuilder:
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            return SimpleNamespace(
                block_table=block_table, planned=(common_prefix_len, fast_build)
            )

    class Builder(TreeMetadataBuilderMixin, StockBuilder):
        pass

    builder = Builder()
    builder.uniform_trees = {N: UniformTreeBuffers(4, N, 64, torch.device("cpu"))}
    gen = torch.Generator().manual_seed(0)
    covering = _published(_random_parents(2, gen), [5, 9])
    second_row = _published(_random_parents(1, gen), [9], rows=[1])
    assert covering.covers_batch and not second_row.covers_batch

    def planned(query_lens: list[int], tree) -> tuple[int, bool]:
        cm = SimpleNamespace(
            causal=True,
            query_start_loc_cpu=torch.tensor([0, *query_lens]).cumsum(0),
            num_reqs=len(query_lens),
            seq_lens=_seq_lens([5, 9], 0),
        )
        with publish_tree(tree):
            return builder.build(5, cm).planned

    assert planned([N, N], covering) == (0, True)
    assert planned([N, N], None) == (0, True)  # n-token prompts: chains
    assert planned([N, 3], covering) == (0, True)
    assert planned([3, N], second_row) == (5, False)
    assert planned([3, 5], None) == (5, False)

    flash = FlashTreeAttentionMetadataBuilder.__new__(FlashTreeAttentionMetadataBuilder)
    buffers = builder.uniform_trees[N]
    for flash.flash_context in (False, True):
        assert flash._skips_stock_pass(covering, buffers) != flash.flash_context
        assert flash._skips_stock_pass(covering, None)
        assert not flash._skips_stock_pass(second_row, None)


def _schedule_config(schedule, chain_from_batch_size=None):
    """An engine config of budget 8 and vLLM's batch-size ``schedule``, as
    :func:`uniform_tree_buffers` reads it."""
    from types import SimpleNamespace

    from vllm_ddtree.config import CONFIG_KEY, DDTreeConfig

    ddtree = DDTreeConfig(
        budget=8,
        max_depth=5,
        adaptive_budget=False,
        model_runner="v2",
        chain_from_batch_size=chain_from_batch_size,
    )
    hf_config = SimpleNamespace(dflash_config={CONFIG_KEY: ddtree.to_dict()})
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            method="dflash",
            draft_model_config=SimpleNamespace(hf_config=hf_config),
            num_speculative_tokens=8,
            num_speculative_tokens_per_batch_size=schedule,
        ),
        model_config=SimpleNamespace(max_model_len=64),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=None),
    )


def test_chain_steps_length_gets_no_buffers():
    """The chain steps' draft length (``ddtree.chain_from_batch_size``, here
    chains of ``max_depth`` 5 from batch size 3) gets no buffers: its uniform
    batches are chains, captured and replayed with FlashAttention."""
    from vllm_ddtree.config import DDTreeConfig, with_chain_steps
    from vllm_ddtree.v1.attention.backends.tree_attn import uniform_tree_buffers

    cfg = DDTreeConfig(budget=8, max_depth=5, chain_from_batch_size=3)
    schedule = with_chain_steps([(1, 1, 8), (2, 16, N - 1)], cfg)
    assert schedule[-1][2] == 5
    chained = uniform_tree_buffers(_schedule_config(schedule, 3), torch.device("cpu"))
    assert sorted(chained) == [N, 9]
    # The same schedule without chain steps: six-node chains at batch 3 on
    # would be trees, with buffers.
    trees = uniform_tree_buffers(_schedule_config(schedule), torch.device("cpu"))
    assert sorted(trees) == [6, N, 9]


def test_schedule_without_speculation_keeps_decode_batches_stock():
    """``K = 0`` in the batch-size schedule turns speculation off at those
    sizes: their one-token decode batches must not match buffers of one
    node, which would run the tree kernel instead of the stock one."""
    from types import SimpleNamespace

    from vllm_ddtree.v1.attention.backends.tree_attn import (
        TreeMetadataBuilderMixin,
        uniform_tree_buffers,
    )

    config = _schedule_config([(1, 1, 8), (2, 16, 0)])
    builder = TreeMetadataBuilderMixin()
    builder.uniform_trees = uniform_tree_buffers(config, torch.device("cpu"))
    assert sorted(builder.uniform_trees) == [9]
    metadata = SimpleNamespace(block_table=torch.zeros(2, 4, dtype=torch.int32))
    cm = SimpleNamespace(
        causal=True,
        query_start_loc_cpu=torch.tensor([0, 1, 2]),
        num_reqs=2,
        seq_lens=torch.tensor([5, 9], dtype=torch.int32),
    )
    assert not builder._attach_tree(metadata, cm, None, builder._uniform_buffers(cm))
    assert metadata.tree is None


def test_schedule_widths_get_buffers_of_their_own():
    """Under a batch-size schedule vLLM captures full graphs for every draft
    length K (V2 runner): a uniform batch of ``1 + K``-node trees must get
    ``1 + K``-node buffers holding the trees' masks (a batch without
    buffers would replay the chain attention its capture saw), and a
    uniform batch of a length no graph has keeps the published tree."""
    from types import SimpleNamespace

    from vllm_ddtree.v1.attention.backends.tree_attn import (
        TreeMetadataBuilderMixin,
        uniform_tree_buffers,
    )

    config = _schedule_config([(1, 1, 8), (2, 16, N - 1)])
    builder = TreeMetadataBuilderMixin()
    builder.uniform_trees = uniform_tree_buffers(config, torch.device("cpu"))
    assert sorted(builder.uniform_trees) == [N, 9]
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 2], [-1, 0, 1, 0, 3, 2, 5]])
    tree = _published(parents, [5, 9])
    block_table = torch.arange(8, dtype=torch.int32).view(2, 4)

    def attach(query_len: int):
        metadata = SimpleNamespace(block_table=block_table)
        cm = SimpleNamespace(
            causal=True,
            query_start_loc_cpu=torch.tensor([0, query_len, 2 * query_len]),
            num_reqs=2,
            seq_lens=_seq_lens([5, 9], 0),
        )
        builder._attach_tree(metadata, cm, tree, builder._uniform_buffers(cm))
        return metadata

    narrow = attach(N)
    mask, _ = narrow.tree.packed
    want, _ = pack_ancestor_mask(tree.mask, [N, N])
    assert torch.equal(mask, want)
    assert not torch.equal(mask, builder.uniform_trees[N].chain_mask[: 2 * N])
    assert torch.equal(narrow.tree.parents, parents)
    # No graph has 5-token queries: the published tree, as for mixed batches.
    assert attach(5).tree is tree


def test_hybrid_tree_batches_stay_piecewise():
    """Under DDTree the GDN builder reports single-token-decode graph
    support (its tree parents are per step, not graph buffers), so vLLM
    keeps hybrid verify batches piecewise; other engines keep vLLM's value."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from vllm_ddtree.config import CONFIG_KEY
    from vllm_ddtree.v1.attention.backends.tree_gdn_attn import (
        TreeGDNAttentionMetadataBuilder,
    )

    def config(dflash_config: dict):
        hf_config = SimpleNamespace(dflash_config=dflash_config)
        spec = SimpleNamespace(
            method="dflash", draft_model_config=SimpleNamespace(hf_config=hf_config)
        )
        return SimpleNamespace(speculative_config=spec)

    ddtree = config({CONFIG_KEY: {"budget": 8, "max_depth": 15}})
    support = TreeGDNAttentionMetadataBuilder.get_cudagraph_support(ddtree, None)
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    stock = TreeGDNAttentionMetadataBuilder.get_cudagraph_support(config({}), None)
    assert stock == GDNAttentionMetadataBuilder.get_cudagraph_support(config({}), None)
    assert stock == AttentionCGSupport.UNIFORM_BATCH
