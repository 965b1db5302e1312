# SPDX-License-Identifier: Apache-2.0
"""The learnt CPU KV-cache layout matches what the stock CPU op writes."""

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from vllm_ddtree.v1.attention.backends.cpu_tree_attn import probe_layout


def _write(cache, key, value, slots, isa):
    nb, heads, bs, packed = cache.shape
    key_cache, value_cache = cache.view(nb, heads, 2 * bs, packed // 2).chunk(2, 2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [32, 64])
def test_gather_and_copy_follow_the_stock_op(dtype, block_size, head_size):
    heads, num_blocks = 2, 4
    isa = _get_attn_isa(dtype, block_size, head_size)
    layout = probe_layout(isa, dtype, block_size, heads, head_size)
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:20]
    key = torch.randn(20, heads, head_size, generator=g).to(dtype)
    value = torch.randn(20, heads, head_size, generator=g).to(dtype)
    _write(cache, key, value, slots, isa)
    got_k, got_v = layout.gather(cache, slots)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)

    # Move entries 0..9 onto the slots of entries 10..19 (overlap-free here)
    # and check the moved values are found there, the sources untouched.
    layout.copy_slots(cache, slots[:10], slots[10:])
    moved_k, moved_v = layout.gather(cache, slots[10:])
    assert torch.equal(moved_k, key[:10]) and torch.equal(moved_v, value[:10])
    kept_k, _ = layout.gather(cache, slots[:10])
    assert torch.equal(kept_k, key[:10])
