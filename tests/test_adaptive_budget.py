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


def test_full_graph_candidate():
    """Uniform full trees compete with their own (full CUDA graph) latency,
    only when every request may take the whole budget."""
    scores = np.log(np.array([[0.9, 0.5, 0.2, 0.1], [0.8, 0.4, 0.3, 0.05]]))
    caps = np.array([4, 4])
    # Piecewise: tokens past 4 cost a lot, so the cut takes 2 nodes.
    piecewise = LatencyModel(np.array([1, 4, 10]), np.array([1.0, 1.0, 4.0]))
    cut = choose_budgets(scores, caps, piecewise)
    assert cut.tolist() == [1, 1]
    cut_rate = _rate(scores, cut, piecewise)
    # A full graph of the 10 tokens that beats the cut's rate wins ...
    cheap = LatencyModel(np.array([5, 10]), np.array([1.0, 1.2]))
    assert choose_budgets(scores, caps, piecewise, cheap).tolist() == [4, 4]
    assert (2 + np.exp(scores).sum()) / 1.2 > cut_rate
    # ... one that does not, loses; a cap below B rules the candidate out.
    dear = LatencyModel(np.array([5, 10]), np.array([1.0, 2.0]))
    assert choose_budgets(scores, caps, piecewise, dear).tolist() == [1, 1]
    assert choose_budgets(scores, np.array([4, 3]), piecewise, cheap).tolist() == [1, 1]


def _runner(
    device="cuda",
    mode="FULL_AND_PIECEWISE",
    capture=512,
    max_num_batched_tokens=8192,
    drafting_reserve=16 * 15,
    schedule=None,
):
    """The runner fields the CUDA-graph and token-budget sizing read (16
    sequences, B=64; vLLM holds ``drafting_reserve`` tokens back;
    ``schedule``: vLLM's batch-size schedule of draft lengths)."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    return SimpleNamespace(
        device=SimpleNamespace(type=device),
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode[mode],
            max_cudagraph_capture_size=capture,
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_scheduled_tokens=max_num_batched_tokens - drafting_reserve,
        ),
        speculative_config=SimpleNamespace(
            num_speculative_tokens_per_batch_size=schedule
        ),
        ddtree=SimpleNamespace(budget=64),
    )


def test_full_graph_grid():
    """Uniform batches of 1, 2, 4, ... full trees up to what one captured
    graph holds; none without full decode graphs or off the GPU."""
    from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin

    def grid(**kwargs):
        return DDTreeModelRunnerMixin._full_graph_grid(_runner(**kwargs))

    assert grid() == [65, 130, 260, 455]  # 7 trees of 65 fit 512 tokens
    assert grid(capture=1040) == [65, 130, 260, 520, 1040]
    # Only what the scheduler may schedule (the drafting reserve left out).
    assert grid(capture=1040, max_num_batched_tokens=1040) == [65, 130, 260, 520, 780]
    assert grid(capture=64) == []
    assert grid(mode="PIECEWISE") == []
    assert grid(device="cpu") == []


def test_uncaptured_full_batch_hint():
    """A startup hint names the capture size a full batch of full trees
    needs (16 x 65 = 1040 tokens), capped by the token budget; silent when
    it fits, without graphs, or off the GPU."""
    from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin

    def hint(**kwargs):
        return DDTreeModelRunnerMixin.uncaptured_full_batch_hint(_runner(**kwargs))

    message = hint()
    assert "more than 512 tokens" in message
    assert "max_cudagraph_capture_size to 1040" in message
    assert "to 600" in hint(max_num_batched_tokens=600, drafting_reserve=0)
    assert hint(capture=1040) is None
    assert hint(capture=512, max_num_batched_tokens=752) is None
    # Under a batch-size schedule the widest batch is 4 trees of 64 nodes
    # (260 tokens; 16 of 16 nodes are 272).
    wide_alone = [(1, 4, 64), (5, 16, 16)]
    assert "to 272" in hint(capture=256, schedule=wide_alone)
    assert hint(capture=272, schedule=wide_alone) is None
    assert hint(mode="NONE") is None
    assert hint(device="cpu") is None


def test_token_budget_hint():
    """A startup warning when vLLM's drafting reserve leaves room for fewer
    than max_num_seqs full trees: 1040 - 16 x 15 = 800 tokens hold 12 trees
    of 65; it names the max_num_batched_tokens that holds 16 (1040 + 240)."""
    from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin

    def hint(**kwargs):
        return DDTreeModelRunnerMixin.token_budget_hint(_runner(**kwargs))

    message = hint(max_num_batched_tokens=1040)
    assert "schedule 800 tokens" in message
    assert "fewer than 16 full trees of 65 nodes" in message
    assert "at most 12 of them" in message
    assert "max_num_batched_tokens to at least 1280" in message
    assert hint(max_num_batched_tokens=1280) is None
    # A batch-size schedule: its widest batch (3 trees of 65 nodes; 16 of 5
    # are 80 tokens) needs 195 + 240.
    message = hint(max_num_batched_tokens=400, schedule=[(1, 3, 64), (4, 16, 4)])
    assert "fewer than 3 full trees of 65 nodes" in message
    assert "at least 435" in message
    assert hint(max_num_batched_tokens=435, schedule=[(1, 3, 64), (4, 16, 4)]) is None
    # Off the GPU too: it is the scheduler's budget, not a kernel's.
    assert "at least 1280" in hint(device="cpu", max_num_batched_tokens=1000)


def test_latency_model_takes_the_median_of_its_runs(monkeypatch):
    """One slow run at a token count (a host stall) does not move the model,
    and the model never makes a larger batch look cheaper."""
    from types import SimpleNamespace

    from vllm_ddtree.v1.worker import ddtree_model_runner as runner_module

    clock = [0.0]
    # Per token count: the warm-up run, then the timed runs (ms).
    durations = {
        8: [50, 2, 2, 20, 2, 2],
        16: [50, 3, 3, 3, 30, 3],
        32: [50, 1, 1, 1, 1, 1],
    }
    calls = {n: iter(d) for n, d in durations.items()}

    def dummy_run(num_tokens, uniform_decode=False):
        clock[0] += next(calls[num_tokens]) * 1e-3

    monkeypatch.setattr(runner_module.time, "perf_counter", lambda: clock[0])
    runner = SimpleNamespace(_dummy_run=dummy_run, device=SimpleNamespace(type="cpu"))
    model = runner_module.DDTreeModelRunnerMixin._latency_model(runner, [8, 16, 32], 5)
    assert np.allclose(model.seconds, [2e-3, 3e-3, 3e-3])
