# SPDX-License-Identifier: Apache-2.0
"""Uniform batches through the CUDA-graph buffers, in the CPU engine.

On a GPU every batch whose requests all run ``1 + B`` query tokens is
described by :class:`UniformTreeBuffers` (the full-graph path) instead of the
runner's published tree. The CPU builder normally has no such buffers; here
it is given some, so that CI runs that path inside a real engine: steady
trees, and trees beside prompts of exactly ``1 + B`` tokens (the batch that
killed the H200 soak's engine on 2026-12-04). Greedy output must equal
no-spec.
"""

from __future__ import annotations

import pytest

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import (
    TREE_SIZED_BUDGET,
    ddtree_config,
    make_llm,
    record_uniform_fills,
    shutdown_llm,
    tree_sized_requests,
)
from vllm_ddtree.v1.attention.backends.cpu_tree_attn import (
    CPUTreeAttentionMetadataBuilder,
)
from vllm_ddtree.v1.attention.backends.tree_attn import UniformTreeBuffers

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 256


def test_uniform_batches_through_graph_buffers(fixtures, monkeypatch):
    requests, params = tree_sized_requests()
    llm = make_llm(
        fixtures.dense_target,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        gpu_memory_utilization=0.25,
    )
    try:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]
    finally:
        shutdown_llm(llm)

    inner_init = CPUTreeAttentionMetadataBuilder.__init__

    def init_with_buffers(self, kv_cache_spec, layer_names, vllm_config, device):
        inner_init(self, kv_cache_spec, layer_names, vllm_config, device)
        self.uniform_trees = UniformTreeBuffers(
            MAX_NUM_SEQS, 1 + TREE_SIZED_BUDGET, MAX_MODEL_LEN, device
        )

    monkeypatch.setattr(CPUTreeAttentionMetadataBuilder, "__init__", init_with_buffers)
    seen = record_uniform_fills(monkeypatch)
    prompts = [r["prompt_token_ids"] for r in requests]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, want, strict=True)})
    with oracle_drafter(oracle):
        llm = make_llm(
            fixtures.dense_target,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            gpu_memory_utilization=0.25,
            speculative_config=ddtree_config(fixtures.dense_drafter, TREE_SIZED_BUDGET),
        )
        try:
            outputs = llm.generate(requests, params)
        finally:
            shutdown_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    # Both kinds of uniform tree batch ran through the buffers.
    assert seen["trees"] > 0 and seen["mixed"] > 0, seen
