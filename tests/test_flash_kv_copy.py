# SPDX-License-Identifier: Apache-2.0
"""The accepted-path KV commit on vLLM's FlashAttention cache layout.

The fast path (one row gather / scatter per layer, NHD layout) and the
generic element-index path (HND layout) must both move exactly the keys and
values of the source slots, including when sources and destinations overlap
and cross block boundaries. Runs on CPU tensors laid out like the GPU cache.
"""

import pytest
import torch

from vllm_ddtree.v1.attention.backends.flash_tree_attn import (
    FlashTreeAttentionImpl,
    slot_rows,
)

NUM_BLOCKS, HEADS, HEAD_SIZE = 6, 2, 8


def _cache(layout: str, block_size: int) -> torch.Tensor:
    """A FlashAttention cache: logical ``(blocks, Hkv, block_size, 2 * D)``,
    physically NHD (slot-major) or HND (logical order)."""
    g = torch.Generator().manual_seed(0)
    if layout == "NHD":
        phys = torch.randn(NUM_BLOCKS, block_size, HEADS, 2 * HEAD_SIZE, generator=g)
        return phys.transpose(1, 2)
    return torch.randn(NUM_BLOCKS, HEADS, block_size, 2 * HEAD_SIZE, generator=g)


def _slots_view(cache: torch.Tensor) -> torch.Tensor:
    """``[slots, Hkv, 2 * D]`` reference view (a copy)."""
    return cache.transpose(1, 2).reshape(-1, HEADS, 2 * HEAD_SIZE).clone()


def _impl() -> FlashTreeAttentionImpl:
    impl = FlashTreeAttentionImpl.__new__(FlashTreeAttentionImpl)
    impl.head_size = HEAD_SIZE
    return impl


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_copy_kv_slots_moves_whole_slots(layout, block_size):
    cache = _cache(layout, block_size)
    assert (slot_rows(cache) is not None) == (layout == "NHD")
    before = _slots_view(cache)
    # An accepted path of a tree laid out from slot 13: nodes 0, 4, 9, 21
    # move to 13, 14, 15, 16 (crossing a block boundary at 16 for block 16,
    # and overlapping: slot 17 = node 4 is read, slot 14 is written).
    src = torch.tensor([13, 17, 22, 34])
    dst = torch.tensor([13, 14, 15, 16])
    _impl().copy_kv_slots(cache, src, dst)
    after = _slots_view(cache)
    expected = before.clone()
    expected[dst] = before[src]
    assert torch.equal(after, expected)
