# SPDX-License-Identifier: Apache-2.0
"""The tree sampler's keyed draw (Gumbel-max keyed by seed and position:
vLLM's V2 op on a GPU, the hash of ``keyed_gumbel.py`` on the CPU): it
samples the target distribution, nodes sharing a position share their draw,
and steps without drafts draw the same way. The CUDA cases run on the device
machine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_ddtree.v1.sample.keyed_gumbel import keyed_uniform
from vllm_ddtree.v1.sample.tree_rejection_sampler import (
    PositionSeededTopKTopP,
    TreeRejectionSampler,
)

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def device(request) -> str:
    return request.param


VOCAB = 12
_M64 = 2**64 - 1


def _fmix64_reference(x: int) -> int:
    """MurmurHash3's fmix64 on Python's unbounded ints, reduced mod 2**64."""
    x &= _M64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def _uniform_reference(seed: int, position: int, token: int) -> float:
    golden = 0x9E3779B97F4A7C15
    row = _fmix64_reference(seed + _fmix64_reference(position * golden))
    bits = _fmix64_reference(row + token * golden)
    return ((bits >> 11) + 0.5) * 2.0**-53


def test_uniforms_equal_the_unsigned_64_bit_hash():
    """torch's wrapping int64 arithmetic computes the uint64 hash exactly,
    negative seeds (vLLM's int64 view of a uint64 seed) included."""
    seeds = [0, 1, 12345, -(2**63), 2**63 - 1, -7]
    positions = [0, 1, 511, 2**31, 3, 100_000]
    got = keyed_uniform(torch.tensor(seeds), torch.tensor(positions), 300)
    for i, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
        for token in (0, 1, 17, 299):
            want = _uniform_reference(seed, pos, token)
            assert got[i, token].item() == want, (seed, pos, token)
    assert got.min() > 0 and got.max() < 1


def _choices(logits, node_req, positions, temperature, seeds=None, top_k=None):
    generators = {}
    for req, seed in (seeds or {}).items():
        generators[req] = torch.Generator(device=logits.device).manual_seed(seed)
    metadata = SimpleNamespace(
        all_greedy=False,
        temperature=temperature,
        top_k=top_k,
        top_p=None,
        generators=generators,
    )
    sampler = SimpleNamespace(use_fp64_gumbel=False)
    rows = SimpleNamespace(
        node_req=torch.as_tensor(np.asarray(node_req), device=logits.device)
    )
    return TreeRejectionSampler._target_choices(
        sampler, logits, rows, positions, metadata
    )


def test_samples_follow_the_processed_distribution(device):
    """Many (request, position) draws of one logit row: chi-square against
    softmax(logits / T) restricted to the top-k."""
    gen = torch.Generator(device=device).manual_seed(0)
    row = torch.randn(VOCAB, device=device, generator=gen) * 1.5
    num_reqs, per_req = 64, 500
    logits = row.expand(num_reqs * per_req, VOCAB).contiguous()
    node_req = np.repeat(np.arange(num_reqs), per_req)
    positions = torch.arange(per_req, device=device).repeat(num_reqs)
    temperature = torch.full((num_reqs,), 0.7, device=device)
    top_k = torch.full((num_reqs,), 8, dtype=torch.int32, device=device)
    got = _choices(logits, node_req, positions, temperature, top_k=top_k)
    counts = torch.bincount(got, minlength=VOCAB).cpu().numpy()
    keep = torch.topk(row, 8).indices.cpu().numpy()
    probs = torch.softmax(row[torch.from_numpy(keep).to(device)] / 0.7, 0).cpu().numpy()
    assert counts.sum() == counts[keep].sum()  # nothing outside the top-k
    expected = probs * counts.sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = len(keep) - 1
    pvalue = float(
        torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2))
    )
    assert pvalue > 1e-4, (counts, probs, pvalue)


def test_one_draw_per_seed_and_position(device):
    """Rows of one seeded request at one position (tree nodes of one depth)
    draw the same noise; other positions and seeds draw afresh; greedy rows
    take the argmax."""
    gen = torch.Generator(device=device).manual_seed(1)
    row = torch.randn(VOCAB, device=device, generator=gen)
    logits = row.expand(3 * 200, VOCAB).contiguous()
    node_req = np.repeat([0, 1, 2], 200)
    positions = torch.arange(200, device=device).repeat(3)
    temperature = torch.tensor([1.0, 1.0, 0.0], device=device)
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


def test_draftless_steps_draw_like_tree_nodes(device):
    """A step without drafts samples through vLLM's Sampler; the wrapped
    top-k / top-p stage draws the same (seed, position) sample as a tree node,
    so a seeded request's first token (its prefill sample) is V2's too."""
    gen = torch.Generator(device=device).manual_seed(2)
    logits = torch.randn(4, VOCAB, device=device, generator=gen)
    positions = torch.tensor([5, 9, 9, 31], device=device)
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.3], device=device)
    top_k = torch.tensor([5, VOCAB, VOCAB, 3], dtype=torch.int32, device=device)
    seeds = {0: 11, 1: 12, 2: 12, 3: 13}
    want = _choices(logits, np.arange(4), positions, temperature, seeds, top_k)

    inner = SimpleNamespace(logprobs_mode="raw_logprobs")
    wrapped = PositionSeededTopKTopP(inner, use_fp64_gumbel=False)
    wrapped.positions = positions
    generators = {
        r: torch.Generator(device=device).manual_seed(s) for r, s in seeds.items()
    }
    got, _ = wrapped(logits / temperature[:, None], generators, top_k, None)
    assert torch.equal(got, want)
    assert wrapped.positions is None  # published positions serve one step
