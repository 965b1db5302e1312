# SPDX-License-Identifier: Apache-2.0
"""The accepted-path KV commit on vLLM's FlashAttention cache layout.

The fast path (one row gather / scatter per layer, NHD layout), the
generic element-index path (HND layout) and the all-layers Triton commit
(one launch for every layer of a group; run here in Triton's interpreter)
must all move exactly the keys and values of the source slots, including when
sources and destinations overlap and cross block boundaries. Runs on CPU
tensors laid out like the GPU cache.
"""

import sys

import pytest
import torch

from tests.utils import interpreted_case, interpreter_fixture, print_case
from vllm_ddtree.v1.attention.backends.flash_tree_attn import (
    FlashTreeAttentionImpl,
    slot_rows,
)

NUM_BLOCKS, HEADS, HEAD_SIZE = 6, 2, 8


def _cache(
    layout: str, block_size: int, heads: int = HEADS, seed: int = 0
) -> torch.Tensor:
    """A FlashAttention cache: logical ``(blocks, Hkv, block_size, 2 * D)``,
    physically NHD (slot-major) or HND (logical order)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "NHD":
        phys = torch.randn(NUM_BLOCKS, block_size, heads, 2 * HEAD_SIZE, generator=g)
        return phys.transpose(1, 2)
    return torch.randn(NUM_BLOCKS, heads, block_size, 2 * HEAD_SIZE, generator=g)


def _slots_view(cache: torch.Tensor) -> torch.Tensor:
    """``[slots, Hkv, 2 * D]`` reference view (a copy)."""
    heads = cache.shape[1]
    return cache.transpose(1, 2).reshape(-1, heads, 2 * HEAD_SIZE).clone()


# An accepted path of a tree laid out from slot 13: nodes 0, 4, 9, 21 move to
# 13, 14, 15, 16 (crossing a block boundary at 16 for block 16, and
# overlapping: slot 17 = node 4 is read, slot 14 is written).
SRC, DST = [13, 17, 22, 34], [13, 14, 15, 16]


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
    src, dst = torch.tensor(SRC), torch.tensor(DST)
    _impl().copy_kv_slots(cache, src, dst)
    after = _slots_view(cache)
    expected = before.clone()
    expected[dst] = before[src]
    assert torch.equal(after, expected)


def test_all_layers_commit_is_for_cuda_nhd_caches_only():
    caches = [_cache("NHD", 16, seed=i) for i in range(3)]
    assert _impl().kv_commit_for_layers(caches) is None  # CPU tensors
    assert _impl().kv_commit_for_layers([_cache("HND", 16)]) is None


def test_all_layers_commit_needs_one_geometry():
    from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit

    same = [slot_rows(_cache("NHD", 16, seed=i)) for i in range(2)]
    assert SlotRowsCommit.for_rows(same) is not None
    wider = slot_rows(_cache("NHD", 16, heads=HEADS + 1))
    assert SlotRowsCommit.for_rows([*same, wider]) is None
    half = slot_rows(_cache("NHD", 16, seed=2).to(torch.bfloat16))
    assert SlotRowsCommit.for_rows([*same, half]) is None


# name: (dtype, heads, layers); 3 heads make a row width (48) that is not a
# power of two.
COMMIT_CASES = {
    "fp32": ("float32", HEADS, 3),
    "bf16-odd-width": ("bfloat16", 3, 4),
}


def _worker() -> None:
    """Run the all-layers Triton commit (interpreter) and print one record
    per case."""
    from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit

    for name, (dtype, heads, num_layers) in COMMIT_CASES.items():
        res: dict = {}
        try:
            caches = [
                _cache("NHD", 16, heads, seed=i).to(getattr(torch, dtype))
                for i in range(num_layers)
            ]
            before = [_slots_view(c) for c in caches]
            commit = SlotRowsCommit.for_rows([slot_rows(c) for c in caches])
            # The tree's tokens on consecutive slots from its root's, and the
            # accepted path by node index.
            slot_mapping = torch.arange(DST[0], SRC[-1] + 1)
            path = torch.tensor([[s - SRC[0] for s in SRC]])
            commit(slot_mapping, torch.zeros(1, dtype=torch.long), path)
            equal = []
            for cache, old in zip(caches, before, strict=True):
                expected = old.clone()
                expected[DST] = old[SRC]
                equal.append(torch.equal(_slots_view(cache), expected))
            res["layers_equal"] = equal
        except Exception as exc:
            res["error"] = repr(exc)
        print_case(name, res)


interp_results = interpreter_fixture(__file__, timeout=300)


@pytest.mark.parametrize("name", list(COMMIT_CASES))
def test_all_layers_commit_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert rec["layers_equal"] and all(rec["layers_equal"]), rec


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
