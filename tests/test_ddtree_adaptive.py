# SPDX-License-Identifier: Apache-2.0
"""Adaptive budgets in the engine: the latency model is measured at startup,
the per-step choice is what gets verified, and greedy output is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from vllm import LLM, SamplingParams

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import ddtree_config, make_llm, metric, shutdown_llm
from vllm_ddtree.v1.spec_decode.adaptive_budget import LatencyModel

pytestmark = pytest.mark.slow

BUDGET = 16
MAX_TOKENS = 32
PROMPTS = [[(29 * i + 5 * j) % 300 + 5 for j in range(3 + i % 7)] for i in range(8)]
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]


def _latency_points(worker) -> list[int]:
    model = worker.model_runner.verify_latency
    return [] if model is None else model.num_tokens.tolist()


def _set_latency(seconds: list[float]):
    def apply(worker) -> None:
        counts = np.arange(1, len(seconds) + 1)
        worker.model_runner.verify_latency = LatencyModel(counts, np.array(seconds))

    return apply


def _drafted(llm: LLM) -> tuple[list[list[int]], int]:
    before = metric(llm, DRAFT_TOKENS) or 0
    outputs = _generate(llm)
    return outputs, metric(llm, DRAFT_TOKENS) - before


def test_adaptive_budget_in_engine(fixtures):
    llm = make_llm(fixtures.dense_target)
    try:
        expected = _generate(llm)
    finally:
        shutdown_llm(llm)
    oracle = Oracle({tuple(p): p + o for p, o in zip(PROMPTS, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, BUDGET, adaptive_budget=True)
    with oracle_drafter(oracle):
        llm = make_llm(fixtures.dense_target, speculative_config=spec)
        try:
            # Measured by the worker after warm-up, up to a full batch of trees.
            (points,) = llm.collective_rpc(_latency_points)
            assert points[0] == 1 and points[-1] >= 16 * (1 + BUDGET) // 2

            outputs, measured = _drafted(llm)
            assert outputs == expected

            # Flat cost: every step verifies the whole tree ...
            llm.collective_rpc(_set_latency([1.0] * 40))
            outputs, flat = _drafted(llm)
            assert outputs == expected
            # ... cost proportional to tokens: no node is worth it.
            llm.collective_rpc(_set_latency([float(i) for i in range(1, 41)]))
            outputs, linear = _drafted(llm)
            assert outputs == expected
        finally:
            shutdown_llm(llm)
    steps_upper_bound = len(PROMPTS) * MAX_TOKENS
    assert flat >= BUDGET * len(PROMPTS) and flat % BUDGET == 0
    assert linear == 0
    assert measured <= steps_upper_bound * BUDGET
