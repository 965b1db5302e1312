# SPDX-License-Identifier: Apache-2.0
"""Uniform batches through the CUDA-graph buffers, in the CPU engine.

On a GPU every batch whose requests all run ``1 + B`` query tokens (or
``1 + K`` for a draft length K of a batch-size schedule) is described by
:class:`UniformTreeBuffers` (the full-graph path) instead of the runner's
published tree. The CPU builder normally has no such buffers; here it is
given the ones a GPU builder makes, so that CI runs that path inside a real
engine: steady trees, trees beside prompts of exactly ``1 + B`` tokens (the
batch that killed the H200 soak's engine on 2026-12-04), and a schedule's
narrow trees. Greedy output must equal no-spec.
"""

from __future__ import annotations

import pytest

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import (
    TREE_SIZED_BUDGET,
    cpu_async_scheduling,
    ddtree_config,
    make_llm,
    record_uniform_fills,
    shutdown_llm,
    tree_sized_requests,
)
from vllm_ddtree.v1.attention.backends.cpu_tree_attn import (
    CPUTreeAttentionMetadataBuilder,
)
from vllm_ddtree.v1.attention.backends.tree_attn import uniform_tree_buffers

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def no_spec(fixtures) -> list[list[int]]:
    requests, params = tree_sized_requests()
    llm = make_llm(
        fixtures.dense_target,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        gpu_memory_utilization=0.25,
    )
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]
    finally:
        shutdown_llm(llm)


def _ddtree_with_graph_buffers(
    fixtures, monkeypatch, no_spec, spec, async_scheduling: bool = False
) -> None:
    """Generate with the CPU builder holding a GPU builder's graph buffers
    and an oracle drafter (long accepted paths); outputs must equal
    no-spec's."""
    inner_init = CPUTreeAttentionMetadataBuilder.__init__

    def init_with_buffers(self, kv_cache_spec, layer_names, vllm_config, device):
        inner_init(self, kv_cache_spec, layer_names, vllm_config, device)
        self.uniform_trees = uniform_tree_buffers(vllm_config, device)

    monkeypatch.setattr(CPUTreeAttentionMetadataBuilder, "__init__", init_with_buffers)
    requests, params = tree_sized_requests()
    prompts = [r["prompt_token_ids"] for r in requests]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, no_spec, strict=True)})
    with oracle_drafter(oracle), cpu_async_scheduling():
        llm = make_llm(
            fixtures.dense_target,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            gpu_memory_utilization=0.25,
            speculative_config=spec,
            async_scheduling=async_scheduling,
        )
        try:
            outputs = llm.generate(requests, params)
        finally:
            shutdown_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == no_spec


def test_uniform_batches_through_graph_buffers(fixtures, monkeypatch, no_spec):
    seen = record_uniform_fills(monkeypatch)
    spec = ddtree_config(fixtures.dense_drafter, TREE_SIZED_BUDGET)
    _ddtree_with_graph_buffers(fixtures, monkeypatch, no_spec, spec)
    # Both kinds of uniform tree batch ran through the buffers.
    assert seen["trees"] > 0 and seen["mixed"] > 0, seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_schedule_trees_through_their_graph_buffers(
    fixtures, monkeypatch, no_spec, async_scheduling
):
    """A batch-size schedule: lone requests verify 1 + 8 nodes, batches of
    2 or 3 the first 1 + 3; both sizes go through buffers of their size,
    also under async scheduling (the V2 runner's only mode), where the
    host's context lengths are upper bounds."""
    seen = record_uniform_fills(monkeypatch)
    spec = ddtree_config(
        fixtures.dense_drafter, TREE_SIZED_BUDGET, adaptive_budget=False
    )
    spec["num_speculative_tokens_per_batch_size"] = [
        (1, 1, TREE_SIZED_BUDGET),
        (2, MAX_NUM_SEQS, 3),
    ]
    _ddtree_with_graph_buffers(fixtures, monkeypatch, no_spec, spec, async_scheduling)
    assert seen["by_size"].keys() == {4, 1 + TREE_SIZED_BUDGET}, seen
