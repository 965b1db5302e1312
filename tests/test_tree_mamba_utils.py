# SPDX-License-Identifier: Apache-2.0
"""Which block receives a tree step's block-boundary state ("align" mode)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_ddtree.v1.worker.tree_mamba_utils import aligned_state_targets, state_window

BLOCK = 4
NUM_SPEC = 5


def _spec() -> MambaSpec:
    return MambaSpec(
        block_size=BLOCK,
        shapes=((2, 3),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=NUM_SPEC,
    )


# (tokens before the root, scheduled nodes, accepted nodes after the root,
#  expected (block index receiving a state, nodes on the path to it) or None)
CASES = [
    # through the root: 6 tokens; the path reaches 8 at its 2nd node.
    (5, 4, 2, (1, 3)),
    # 5 -> 6: no multiple of 4 passed.
    (4, 4, 1, None),
    # The root itself is token 8: its state is block 1's.
    (7, 3, 0, (1, 1)),
    # Accepted through 12, having passed 8 too: the last multiple counts.
    (7, 6, 4, (2, 5)),
    # The whole tree accepted as a chain ending at 8: block 1 is the
    # window's start, where the commit puts that state anyway.
    (5, 3, 2, None),
]


@pytest.mark.parametrize("ctx_len, nodes, accepted, expected", CASES)
def test_aligned_state_targets(ctx_len, nodes, accepted, expected):
    # Block ids 100 + position index, so the result names the block index.
    table = torch.arange(12, dtype=torch.int32)[None] + 100
    seq_lens = torch.tensor([ctx_len + nodes])
    window = state_window(table, seq_lens, _spec(), "align")
    start = (ctx_len + nodes - 1) // BLOCK
    assert window.tolist() == [[100 + start + j for j in range(1 + NUM_SPEC)]]
    dst, path_len = aligned_state_targets(
        table,
        window,
        torch.tensor([ctx_len]),
        seq_lens,
        torch.tensor([accepted]),
        BLOCK,
    )
    if expected is None:
        # A self-copy of the root's state: nothing changes.
        assert (int(dst), int(path_len)) == (int(window[0, 0]), 1)
    else:
        block, length = expected
        assert (int(dst), int(path_len)) == (100 + block, length)


def test_rows_are_independent():
    table = torch.arange(24, dtype=torch.int32).view(2, 12) + 100
    ctx = torch.tensor([5, 4])
    nodes = torch.tensor([4, 4])
    window = state_window(table, ctx + nodes, _spec(), "align")
    dst, path_len = aligned_state_targets(
        table, window, ctx, ctx + nodes, torch.tensor([2, 1]), BLOCK
    )
    assert dst.tolist() == [101, 112 + (4 + 4 - 1) // BLOCK]
    assert path_len.tolist() == [3, 1]


@pytest.mark.parametrize("mode", ["none", "align"])
def test_warm_up_commit_changes_no_state(mode):
    """The start-up warm-up of the GDN commit (the Triton kernels compile
    there on a GPU; here the torch path runs) leaves every state as it was:
    its one row accepted nothing and its block table is empty."""
    from functools import partial
    from types import SimpleNamespace

    from vllm_ddtree.v1.worker.ddtree_model_runner import (
        DDTreeModelRunnerMixin,
        warm_up_gdn_commit,
    )

    width, dim, slots = 4, 6, 8
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=((width - 1 + NUM_SPEC, dim), (2, 3, 3)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode=mode,
        num_speculative_blocks=NUM_SPEC,
    )
    g = torch.Generator().manual_seed(0)
    layers = {
        name: SimpleNamespace(
            kv_cache=[
                torch.randn(slots, width - 1 + NUM_SPEC, dim, generator=g),
                torch.randn(slots, 2, 3, 3, generator=g),
            ],
            conv_kernel_size=width,
        )
        for name in ("gdn.0", "gdn.1")
    }
    before = {n: [t.clone() for t in layer.kv_cache] for n, layer in layers.items()}
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        ddtree=SimpleNamespace(max_depth=3),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[*layers])]
        ),
        _gdn_commits={},
    )
    runner._commit_gdn_paths = partial(DDTreeModelRunnerMixin._commit_gdn_paths, runner)
    table = torch.zeros(1, 12 if mode == "align" else 1 + NUM_SPEC, dtype=torch.int32)
    warm_up_gdn_commit(runner, lambda gid: table)
    assert [*runner._gdn_commits] == [0]
    for name, layer in layers.items():
        for have, want in zip(layer.kv_cache, before[name], strict=True):
            assert torch.equal(have, want), name
