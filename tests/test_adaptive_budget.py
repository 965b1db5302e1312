# SPDX-License-Identifier: Apache-2.0
"""Adaptive tree budgets: the latency model and the per-step node choice."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_ddtree.v1.spec_decode.adaptive_budget import LatencyModel, choose_budgets


def _rate(scores, budgets, latency):
    num_reqs = len(budgets)
    expected = num_reqs + sum(
        np.exp(scores[r, :k]).sum() for r, k in enumerate(budgets)
    )
    return expected / float(latency(num_reqs + sum(budgets)))


def test_latency_model_interpolates_and_extrapolates():
    model = LatencyModel(np.array([1, 4, 8]), np.array([1.0, 1.0, 2.0]))
    assert np.allclose(model(np.array([0, 1, 2, 6, 8, 12])), [1, 1, 1, 1.5, 2, 3])
    with pytest.raises(ValueError):
        LatencyModel(np.array([4]), np.array([1.0]))
    with pytest.raises(ValueError):
        LatencyModel(np.array([4, 4]), np.array([1.0, 2.0]))


@pytest.mark.parametrize("seed", range(40))
def test_choice_is_optimal_over_all_prefix_allocations(seed):
    rng = np.random.default_rng(seed)
    num_reqs, width = rng.integers(1, 4), rng.integers(1, 6)
    # Best-first trees: path log-probs never increase along a row.
    steps = np.log(rng.uniform(0.05, 1.0, size=(num_reqs, width)))
    scores = -np.sort(-steps, axis=1)
    caps = rng.integers(0, width + 1, size=num_reqs)
    # A step function of the token count, like tile quantisation on a GPU.
    counts = np.array([1, 2, 4, 8, 16, 32])
    latency = LatencyModel(counts, np.sort(rng.uniform(1.0, 3.0, size=len(counts))))

    budgets = choose_budgets(scores, caps, latency)
    assert np.all((budgets >= 0) & (budgets <= caps))
    best = max(
        _rate(scores, combo, latency)
        for combo in itertools.product(*[range(c + 1) for c in caps])
    )
    assert _rate(scores, budgets, latency) == pytest.approx(best, rel=1e-12)


def test_flat_latency_takes_everything_and_linear_latency_nothing():
    scores = np.log(np.array([[0.9, 0.8, 0.5], [0.6, 0.3, 0.1]]))
    caps = np.array([3, 2])
    flat = LatencyModel(np.array([1, 64]), np.array([1.0, 1.0]))
    assert choose_budgets(scores, caps, flat).tolist() == [3, 2]
    # Cost proportional to tokens: a node pays off only if p > 1, never.
    linear = LatencyModel(np.array([1, 64]), np.array([1.0, 64.0]))
    assert choose_budgets(scores, caps, linear).tolist() == [0, 0]


def test_ties_are_broken_in_tree_order():
    scores = np.log(np.full((2, 4), 0.5))
    latency = LatencyModel(np.array([1, 2, 3, 4, 5]), np.array([1, 1, 1, 1, 3.0]))
    # 2 roots + 2 nodes fill the flat part; equal nodes go in row-major order.
    assert choose_budgets(scores, np.array([4, 4]), latency).tolist() == [2, 0]
