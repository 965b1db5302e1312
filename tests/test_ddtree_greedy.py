# SPDX-License-Identifier: Apache-2.0
"""Greedy DDTree output equals no-spec output, token for token (CPU engine).

Engines run in-process so the oracle drafter (``oracle_drafter.py``) can
steer the trees: with it, paths of several nodes through first and later
siblings get accepted, which exercises the KV compaction, the depth
positions, the tree masks and the drafter's reordered context. One engine per
(budget, KV block size); every engine serves the prompts at batch 16, 4 and 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from vllm import LLM, SamplingParams

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import (
    cpu_async_scheduling,
    ddtree_config,
    drafts_verified_without_tree,
    make_llm,
    metric,
    shutdown_llm,
    watching_runner,
)

pytestmark = pytest.mark.slow

NUM_PROMPTS = 20
MAX_TOKENS = 48
BLOCK_SIZES = (16, 32)


def _prompts() -> list[list[int]]:
    return [
        [(37 * i + 11 * j) % 300 + 5 for j in range(2 + (i * 7) % 13)]
        for i in range(NUM_PROMPTS)
    ]


def _generate(llm: LLM, prompts: list[list[int]], batch: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = []
    for i in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(chunk, params)]
    return outputs


@pytest.fixture(scope="module")
def reference(fixtures) -> dict[int, list[list[int]]]:
    """No-spec greedy outputs per KV block size."""
    out = {}
    for block_size in BLOCK_SIZES:
        llm = make_llm(fixtures.dense_target, block_size=block_size)
        out[block_size] = _generate(llm, _prompts(), batch=16)
        shutdown_llm(llm)
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("budget", [1, 8, 64])
def test_greedy_equals_no_spec(fixtures, reference, budget, block_size):
    prompts = _prompts()
    expected = reference[block_size]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, budget)
    with oracle_drafter(oracle):
        llm = make_llm(
            fixtures.dense_target, block_size=block_size, speculative_config=spec
        )
        for batch, subset in ((16, NUM_PROMPTS), (4, 8), (1, 3)):
            got = _generate(llm, prompts[:subset], batch)
            for i, (want, have) in enumerate(zip(expected, got, strict=False)):
                assert have == want, f"prompt {i} differs at batch {batch}"
        drafts = metric(llm, "vllm:spec_decode_num_drafts")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        shutdown_llm(llm)
    # The oracle makes trees accept: the test is only meaningful if they do.
    mean_accepted = accepted / drafts
    assert mean_accepted > (0.5 if budget == 1 else 1.2), mean_accepted


@pytest.mark.parametrize("budget", [8, 64])
def test_greedy_equals_no_spec_with_async_scheduling(fixtures, reference, budget):
    """vLLM's async scheduler schedules each step before the last one's walk
    is known: the runner sees context lengths that count every node as
    accepted, corrected on the device, and drafts that never reach the host.
    Requests of different lengths finish at different steps, so rows move
    between steps too. Every verified draft must still be found as a tree
    (a lost tree would be verified as a chain: still lossless, so only this
    check would notice)."""
    prompts = _prompts()
    expected = reference[16]
    lengths = [MAX_TOKENS - 5 * (i % 7) for i in range(NUM_PROMPTS)]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, budget, adaptive_budget=False)
    with (
        oracle_drafter(oracle),
        cpu_async_scheduling(),
        drafts_verified_without_tree() as rows_without_tree,
    ):
        llm = make_llm(
            fixtures.dense_target,
            block_size=16,
            speculative_config=spec,
            async_scheduling=True,
        )
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling
        params = [
            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            for n in lengths
        ]
        for batch in (16, 1):
            got = []
            for i in range(0, NUM_PROMPTS if batch > 1 else 3, batch):
                chunk = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
                outputs = llm.generate(chunk, params[i : i + batch])
                got += [list(o.outputs[0].token_ids) for o in outputs]
            for i, have in enumerate(got):
                assert have == expected[i][: lengths[i]], (
                    f"prompt {i} differs at batch {batch}"
                )
        drafts = metric(llm, "vllm:spec_decode_num_drafts")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        shutdown_llm(llm)
    assert not rows_without_tree
    assert accepted / drafts > 1.2, accepted / drafts


@contextmanager
def draft_lengths_per_step() -> Iterator[list[tuple[int, int]]]:
    """Record, for every step of DDTree engines made in this process, the
    number of scheduled requests and the longest draft verified."""
    steps: list[tuple[int, int]] = []

    def record(runner, scheduler_output) -> None:
        drafts = scheduler_output.scheduled_spec_decode_tokens.values()
        reqs = len(scheduler_output.num_scheduled_tokens)
        steps.append((reqs, max(map(len, drafts), default=0)))

    with watching_runner("_prepare_inputs", record):
        yield steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batch_size_schedule_sizes_the_trees(fixtures, reference, async_scheduling):
    """vLLM's ``num_speculative_tokens_per_batch_size`` with fixed budgets:
    the drafts a step verifies are the first K nodes of each tree, K looked
    up by the batch size of the step that drafted them (1 request: the whole
    budget of 8; more: 3). Greedy output stays no-spec's."""
    budget, wide, narrow = 8, 8, 3
    prompts = _prompts()
    expected = reference[16]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, budget, adaptive_budget=False)
    spec["num_speculative_tokens_per_batch_size"] = [(1, 1, wide), (2, 64, narrow)]
    with (
        oracle_drafter(oracle),
        cpu_async_scheduling(),
        drafts_verified_without_tree() as rows_without_tree,
        draft_lengths_per_step() as steps,
    ):
        llm = make_llm(
            fixtures.dense_target,
            block_size=16,
            speculative_config=spec,
            async_scheduling=async_scheduling,
        )
        for batch, subset in ((16, NUM_PROMPTS), (1, 2)):
            got = _generate(llm, prompts[:subset], batch)
            for i, (want, have) in enumerate(zip(expected, got, strict=False)):
                assert have == want, f"prompt {i} differs at batch {batch}"
        shutdown_llm(llm)
    assert not rows_without_tree
    for (reqs, _), (_, longest) in itertools.pairwise(steps):
        assert longest <= (wide if reqs == 1 else narrow), steps
    assert {narrow, wide} <= {longest for _, longest in steps}, steps
