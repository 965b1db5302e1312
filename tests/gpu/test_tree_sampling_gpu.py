# SPDX-License-Identifier: Apache-2.0
"""The tree sampler's GPU draw (vLLM's V2 Gumbel-max keyed by seed and
position): it samples the target distribution, and nodes sharing a position
share their draw.

Run on the device machine: ``python -m pytest tests/gpu/test_tree_sampling_gpu.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.v1.sample.tree_rejection_sampler import TreeRejectionSampler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 12


def _choices(logits, node_req, positions, temperature, seeds=None, top_k=None):
    generators = {}
    for req, seed in (seeds or {}).items():
        generators[req] = torch.Generator(device="cuda").manual_seed(seed)
    metadata = SimpleNamespace(
        all_greedy=False,
        temperature=temperature,
        top_k=top_k,
        top_p=None,
        generators=generators,
    )
    sampler = SimpleNamespace(use_fp64_gumbel=False)
    rows = SimpleNamespace(
        node_req=torch.as_tensor(np.asarray(node_req), device="cuda")
    )
    return TreeRejectionSampler._gumbel_choices(
        sampler, logits, rows, positions, metadata
    )


def test_samples_follow_the_processed_distribution():
    """Many (request, position) draws of one logit row: chi-square against
    softmax(logits / T) restricted to the top-k."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    row = torch.randn(VOCAB, device="cuda", generator=gen) * 1.5
    num_reqs, per_req = 64, 500
    logits = row.expand(num_reqs * per_req, VOCAB).contiguous()
    node_req = np.repeat(np.arange(num_reqs), per_req)
    positions = torch.arange(per_req, device="cuda").repeat(num_reqs)
    temperature = torch.full((num_reqs,), 0.7, device="cuda")
    top_k = torch.full((num_reqs,), 8, dtype=torch.int32, device="cuda")
    got = _choices(logits, node_req, positions, temperature, top_k=top_k)
    counts = torch.bincount(got, minlength=VOCAB).cpu().numpy()
    keep = torch.topk(row, 8).indices.cpu().numpy()
    probs = torch.softmax(row[torch.from_numpy(keep).cuda()] / 0.7, 0).cpu().numpy()
    assert counts.sum() == counts[keep].sum()  # nothing outside the top-k
    expected = probs * counts.sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = len(keep) - 1
    pvalue = float(
        torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2))
    )
    assert pvalue > 1e-4, (counts, probs, pvalue)


def test_one_draw_per_seed_and_position():
    """Rows of one seeded request at one position (tree nodes of one depth)
    draw the same noise; other positions and seeds draw afresh; greedy rows
    take the argmax."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    row = torch.randn(VOCAB, device="cuda", generator=gen)
    logits = row.expand(3 * 200, VOCAB).contiguous()
    node_req = np.repeat([0, 1, 2], 200)
    positions = torch.arange(200, device="cuda").repeat(3)
    temperature = torch.tensor([1.0, 1.0, 0.0], device="cuda")
    seeds = {0: 7, 1: 7}
    first = _choices(logits, node_req, positions, temperature, seeds)
    again = _choices(logits, node_req, positions, temperature, seeds)
    assert torch.equal(first, again)
    # Requests 0 and 1 share a seed: same draw at every position.
    assert torch.equal(first[:200], first[200:400])
    # The draw changes with the position (not one token throughout).
    assert len(set(first[:200].tolist())) > 1
    assert (first[400:] == row.argmax()).all()
    other = _choices(logits, node_req, positions, temperature, {0: 8, 1: 7})
    assert not torch.equal(other[:200], first[:200])
    assert torch.equal(other[200:400], first[200:400])


def test_draftless_steps_draw_like_tree_nodes():
    """A step without drafts samples through vLLM's Sampler; the wrapped
    top-k / top-p stage draws the same (seed, position) sample as a tree node,
    so a seeded request's first token (its prefill sample) is V2's too."""
    from vllm_ddtree.v1.sample.tree_rejection_sampler import PositionSeededTopKTopP

    gen = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(4, VOCAB, device="cuda", generator=gen)
    positions = torch.tensor([5, 9, 9, 31], device="cuda")
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.3], device="cuda")
    top_k = torch.tensor([5, VOCAB, VOCAB, 3], dtype=torch.int32, device="cuda")
    seeds = {0: 11, 1: 12, 2: 12, 3: 13}
    want = _choices(logits, np.arange(4), positions, temperature, seeds, top_k)

    inner = SimpleNamespace(logprobs_mode="raw_logprobs")
    wrapped = PositionSeededTopKTopP(inner, use_fp64_gumbel=False)
    wrapped.positions = positions
    generators = {
        r: torch.Generator(device="cuda").manual_seed(s) for r, s in seeds.items()
    }
    got, _ = wrapped(logits / temperature[:, None], generators, top_k, None)
    assert torch.equal(got, want)
    assert wrapped.positions is None  # published positions serve one step
