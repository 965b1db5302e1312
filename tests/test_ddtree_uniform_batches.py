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
from vllm import SamplingParams

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import ddtree_config, make_llm, shutdown_llm
from vllm_ddtree.v1.attention.backends.cpu_tree_attn import (
    CPUTreeAttentionMetadataBuilder,
)
from vllm_ddtree.v1.attention.backends.tree_attn import UniformTreeBuffers

pytestmark = pytest.mark.slow

BUDGET = 8
MAX_NUM_SEQS = 3
MAX_MODEL_LEN = 256


def _requests() -> tuple[list[dict], list[SamplingParams]]:
    """Eight ``1 + B``-token prompts with staggered lengths: three slots
    admit them one or two at a time beside running trees."""
    prompts = [
        [(13 * i + 5 * j) % 300 + 5 for j in range(1 + BUDGET)] for i in range(8)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=16 + 8 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


def test_uniform_batches_through_graph_buffers(fixtures, monkeypatch):
    requests, params = _requests()
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
    inner_fill = UniformTreeBuffers.fill
    seen = {"trees": 0, "mixed": 0}

    def init_with_buffers(self, kv_cache_spec, layer_names, vllm_config, device):
        inner_init(self, kv_cache_spec, layer_names, vllm_config, device)
        self.uniform_trees = UniformTreeBuffers(
            MAX_NUM_SEQS, 1 + BUDGET, MAX_MODEL_LEN, device
        )

    def counted_fill(self, num_reqs, seq_lens, tree):
        if tree is not None:
            seen["trees" if tree.covers_batch else "mixed"] += 1
        return inner_fill(self, num_reqs, seq_lens, tree)

    monkeypatch.setattr(CPUTreeAttentionMetadataBuilder, "__init__", init_with_buffers)
    monkeypatch.setattr(UniformTreeBuffers, "fill", counted_fill)
    prompts = [r["prompt_token_ids"] for r in requests]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, want, strict=True)})
    with oracle_drafter(oracle):
        llm = make_llm(
            fixtures.dense_target,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_NUM_SEQS,
            gpu_memory_utilization=0.25,
            speculative_config=ddtree_config(fixtures.dense_drafter, BUDGET),
        )
        try:
            outputs = llm.generate(requests, params)
        finally:
            shutdown_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    # Both kinds of uniform tree batch ran through the buffers.
    assert seen["trees"] > 0 and seen["mixed"] > 0, seen
