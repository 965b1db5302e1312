# SPDX-License-Identifier: Apache-2.0
"""The all-layers Triton GDN commit equals the torch reference.

``GDNStateCommit`` (two launches for every layer) must leave each layer's
conv and recurrent caches exactly as ``commit_tree_state`` does layer by
layer: random trees and accepted paths, the commit in place (column 0) and
into other slots (prefix caching's block-boundary states), both conv cache
layouts. Run under ``TRITON_INTERPRET=1`` in one subprocess.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.test_tree_gdn_ops import leaf_paths, make_gdn_batch
from tests.utils import interpreted_case, interpreter_fixture, run_case
from vllm_ddtree.v1.ops.tree_gdn import commit_tree_state

# name: (tree sizes, layers, conv cache dim-first, commit into other slots)
CASES = {
    "in_place": ([6, 1, 9, 4], 3, True, False),
    "elsewhere": ([5, 8], 2, True, True),
    "dim_last_layout": ([7, 3, 2], 2, False, False),
    "dim_last_elsewhere": ([4, 10], 3, False, True),
}


def _layer_caches(batch, num_layers: int, dim_first: bool):
    """Per layer: a conv cache view ``[slots, dim, cols]`` (physically
    ``[slots, cols, dim]`` unless ``dim_first``) and a recurrent-state
    cache, each with its own random contents."""
    gen = torch.Generator().manual_seed(num_layers)
    caches = []
    for _ in range(num_layers):
        conv = torch.randn(batch.conv_state.shape, generator=gen)
        if not dim_first:
            conv = conv.transpose(1, 2).contiguous().transpose(1, 2)
        caches.append((conv, torch.randn(batch.ssm_state.shape, generator=gen)))
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
    """Run case ``name`` on ``device``: per layer, whether the Triton
    commit's conv and recurrent caches equal the reference's, and whether
    the reference changed each cache at all."""
    from vllm_ddtree.v1.ops.triton_gdn_commit import GDNStateCommit

    sizes, num_layers, dim_first, elsewhere = CASES[name]
    batch = make_gdn_batch(sizes, seed=len(name), spare_slots=len(sizes))
    slots = batch.state_indices
    width = batch.conv_weight.shape[1]
    path, path_len = _paths(batch, seed=len(sizes))
    dst = None
    if elsewhere:
        used = set(slots.flatten().tolist())
        free = [s for s in range(1, batch.ssm_state.shape[0]) if s not in used]
        dst = torch.tensor(free[: len(sizes)], dtype=torch.int32)
    before = _layer_caches(batch, num_layers, dim_first)
    want = [(c.clone(), s.clone()) for c, s in before]
    for conv, ssm in want:
        commit_tree_state(conv, ssm, slots[:, 0], slots, path, path_len, width, dst)
    caches = [(c.to(device, copy=True), s.to(device, copy=True)) for c, s in before]
    on_device = [t.to(device) if t is not None else None for t in (slots, dst)]
    GDNStateCommit([c for c, _ in caches], [s for _, s in caches])(
        on_device[0], path.to(device), path_len.to(device), width, on_device[1]
    )
    pairs = list(zip(caches, want, strict=True))
    return {
        "conv_equal": [torch.equal(c.cpu(), w) for (c, _), (w, _) in pairs],
        "ssm_equal": [torch.equal(s.cpu(), w) for (_, s), (_, w) in pairs],
        # The comparison can fail: the reference changed every cache.
        "changed": [
            not torch.equal(new, old)
            for pair, old_pair in zip(want, before, strict=True)
            for new, old in zip(pair, old_pair, strict=True)
        ],
    }


def check_commit_case(rec: dict) -> None:
    assert all(rec["changed"]), rec
    assert all(rec["conv_equal"]) and all(rec["ssm_equal"]), rec


def _worker() -> None:
    for name in CASES:
        run_case(name, lambda name=name: commit_case(name))


interp_results = interpreter_fixture(__file__, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_all_layers_gdn_commit_interpreted(interp_results, name):
    check_commit_case(interpreted_case(interp_results, name))


def test_all_layers_gdn_commit_is_for_cuda_caches_of_one_geometry():
    from vllm_ddtree.v1.ops.triton_gdn_commit import GDNStateCommit

    batch = make_gdn_batch([3, 2])
    caches = _layer_caches(batch, 2, True)
    convs, ssms = [c for c, _ in caches], [s for _, s in caches]
    assert GDNStateCommit.for_layers(convs, ssms) is None  # CPU tensors
    if not torch.cuda.is_available():
        return
    convs, ssms = [c.cuda() for c in convs], [s.cuda() for s in ssms]
    assert GDNStateCommit.for_layers(convs, ssms) is not None
    assert GDNStateCommit.for_layers(convs, [ssms[0], ssms[1].half()]) is None


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
