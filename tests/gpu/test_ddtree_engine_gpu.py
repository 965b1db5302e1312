# SPDX-License-Identifier: Apache-2.0
"""DDTree on a CUDA GPU: greedy output equals no-spec (FlashAttention + the
Triton tree pass), with the oracle drafter so that trees accept, eager and
with CUDA graphs, over two KV block sizes, under async (vLLM's default for
fixed budgets on a GPU) and synchronous scheduling; plus stock DFlash as the
baseline that must keep working with the plugin installed.

Run on the device machine: ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import pytest
import torch
from vllm import LLM, SamplingParams

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import (
    TREE_SIZED_BUDGET,
    ddtree_config,
    ddtree_kernels_compiled,
    dflash_config,
    drafts_verified_without_tree,
    fail_on_host_sync,
    make_llm,
    metric,
    record_uniform_fills,
    shutdown_llm,
    tree_sized_requests,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[(31 * i + 7 * j) % 300 + 5 for j in range(3 + i)] for i in range(12)]
MAX_TOKENS = 64
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def _engine(
    model,
    enforce_eager: bool,
    block_size: int = 16,
    spec=None,
    max_num_seqs=16,
    async_scheduling: bool | None = None,
) -> LLM:
    return make_llm(
        model,
        async_scheduling=async_scheduling,
        enforce_eager=enforce_eager,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        # A fixed KV size: in-process engines do not hand their GPU memory
        # back, which breaks vLLM's free-memory profiling for the next one.
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.4,
        # Piecewise CUDA graphs without Inductor: same graph capture and
        # replay, a fraction of the compile time.
        compilation_config=None if enforce_eager else {"backend": "eager"},
        speculative_config=spec,
    )


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]


@pytest.fixture(scope="module")
def expected(fixtures) -> list[list[int]]:
    llm = _engine(fixtures.dense_target, enforce_eager=True)
    try:
        return _generate(llm)
    finally:
        shutdown_llm(llm)


# Fixed budgets schedule asynchronously by default on a GPU (vLLM's
# default); ``sync`` cases pin synchronous scheduling.
@pytest.mark.parametrize(
    ("enforce_eager", "block_size", "budget", "scheduling"),
    [
        (True, 16, 8, "async"),
        (True, 32, 64, "async"),
        (False, 16, 8, "async"),
        (False, 16, 64, "async"),
        (True, 16, 8, "sync"),
        (False, 16, 64, "sync"),
    ],
)
def test_greedy_equals_no_spec_on_gpu(
    fixtures, expected, enforce_eager, block_size, budget, scheduling
):
    oracle = Oracle({tuple(p): p + o for p, o in zip(PROMPTS, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, budget)
    with oracle_drafter(oracle), drafts_verified_without_tree() as without_tree:
        llm = _engine(
            fixtures.dense_target,
            enforce_eager,
            block_size,
            spec,
            async_scheduling=scheduling == "async",
        )
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling == (
            scheduling == "async"
        )
        try:
            # Prometheus counters are process-wide: measure this engine's share.
            before = metric(llm, ACCEPTED) or 0
            with ddtree_kernels_compiled() as compiled:
                assert _generate(llm) == expected
                accepted = metric(llm, ACCEPTED) - before
                # Batch 1 too: a lone tree row next to no other request.
                assert _generate(llm, PROMPTS[:1]) == expected[:1]
        finally:
            shutdown_llm(llm)
    # The start-up warm-up compiled every kernel variant the steps used.
    assert not compiled, compiled
    # The oracle makes trees accept several tokens per step; otherwise the
    # compaction and depth positions would go untested.
    assert accepted > len(PROMPTS) * MAX_TOKENS // 4
    assert not without_tree


def test_small_max_num_seqs_with_cuda_graphs(fixtures, expected):
    """4 x 65 drafter queries are off the CUDA-graph size grid: the captured
    drafter runs pad past DFlash's own buffer sizes (a start-up crash once)."""
    prompts = PROMPTS[:4]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, expected, strict=False)})
    spec = ddtree_config(fixtures.dense_drafter, 64)
    with oracle_drafter(oracle):
        llm = _engine(fixtures.dense_target, False, spec=spec, max_num_seqs=4)
        try:
            assert _generate(llm, prompts) == expected[:4]
        finally:
            shutdown_llm(llm)


@pytest.fixture(scope="module")
def tree_sized(fixtures):
    """The ``1 + B``-token requests (also run by the CPU engine test) and
    their no-spec greedy outputs."""
    requests, params = tree_sized_requests()
    llm = _engine(fixtures.dense_target, enforce_eager=True)
    try:
        outputs = llm.generate(requests, params)
    finally:
        shutdown_llm(llm)
    return requests, params, [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("flash_context", [False, True])
def test_trees_beside_prompts_of_tree_size(
    fixtures, tree_sized, flash_context, monkeypatch
):
    """Prompts of exactly ``1 + B`` tokens admitted while other requests
    verify trees make uniform batches that are not all trees (the H200 soak's
    engine died on one on 2026-12-04): three slots for eight requests of
    staggered lengths admit them one or two at a time beside running trees.
    With ``flash_context`` those prompts' rows have no context at all."""
    seen = record_uniform_fills(monkeypatch)
    requests, params, want = tree_sized
    prompts = [r["prompt_token_ids"] for r in requests]
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, want, strict=True)})
    spec = ddtree_config(
        fixtures.dense_drafter, TREE_SIZED_BUDGET, flash_context=flash_context
    )
    with oracle_drafter(oracle):
        llm = _engine(fixtures.dense_target, False, spec=spec, max_num_seqs=3)
        try:
            outputs = llm.generate(requests, params)
        finally:
            shutdown_llm(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert seen["mixed"] > 0  # such a batch did run


def test_stock_dflash_still_works_on_gpu(fixtures, expected):
    spec = dflash_config(fixtures.dense_drafter)
    llm = _engine(fixtures.dense_target, enforce_eager=False, spec=spec)
    try:
        assert _generate(llm) == expected
    finally:
        shutdown_llm(llm)


def test_seeded_samples_equal_v2_no_spec(fixtures, monkeypatch):
    """At T > 0 every node's target sample is vLLM's V2 draw for (seed,
    position), so seeded DDTree output equals, token for token, seeded
    no-spec output of vLLM's V2 runner (the GPU default for dense models)."""
    params = [
        SamplingParams(
            temperature=1.0 if i % 2 else 0.8,
            top_k=-1 if i % 2 else 20,
            top_p=1.0 if i % 2 else 0.9,
            seed=1000 + i,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
        for i in range(len(PROMPTS))
    ]
    requests = [{"prompt_token_ids": p} for p in PROMPTS]

    def generate(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]

    # A DDTree engine pins this process to the V1 runner: the reference first.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    llm = _engine(fixtures.dense_target, enforce_eager=False)
    try:
        expected = generate(llm)
    finally:
        shutdown_llm(llm)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    spec = ddtree_config(fixtures.dense_drafter, 16)
    llm = _engine(fixtures.dense_target, enforce_eager=False, spec=spec)
    try:
        assert generate(llm) == expected
    finally:
        shutdown_llm(llm)


def test_flash_context_greedy_equals_no_spec(fixtures, expected, monkeypatch):
    """``ddtree.flash_context``: uniform tree batches (full CUDA graphs) take
    FlashAttention over the context + the tree-only pass, and greedy output
    still equals no-spec."""
    from vllm_ddtree.v1.attention.backends import flash_tree_attn

    calls = []
    inner = flash_tree_attn.flash_context_tree_attention

    def counted(*args, **kwargs):
        calls.append(1)
        inner(*args, **kwargs)

    monkeypatch.setattr(flash_tree_attn, "flash_context_tree_attention", counted)
    oracle = Oracle({tuple(p): p + o for p, o in zip(PROMPTS, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, 64, flash_context=True)
    with oracle_drafter(oracle):
        llm = _engine(fixtures.dense_target, False, spec=spec)
        try:
            assert _generate(llm) == expected
            assert _generate(llm, PROMPTS[:1]) == expected[:1]
        finally:
            shutdown_llm(llm)
    assert calls  # captured (or run eagerly) at least once


def _full_graph_points(worker) -> list[int]:
    model = worker.model_runner.full_graph_latency
    return [] if model is None else model.num_tokens.tolist()


def test_adaptive_budget_measures_full_graphs(fixtures, expected):
    """With CUDA graphs the adaptive budget also times uniform batches of
    full trees (full graphs) and greedy output stays equal to no-spec."""
    oracle = Oracle({tuple(p): p + o for p, o in zip(PROMPTS, expected, strict=True)})
    spec = ddtree_config(fixtures.dense_drafter, 16, adaptive_budget=True)
    with oracle_drafter(oracle):
        llm = _engine(fixtures.dense_target, False, spec=spec)
        try:
            (points,) = llm.collective_rpc(_full_graph_points)
            assert points[:2] == [17, 34]
            assert _generate(llm) == expected
        finally:
            shutdown_llm(llm)


def test_async_step_parts_never_wait_for_the_gpu(fixtures, expected, monkeypatch):
    """Under async scheduling DDTree's own parts of a step (verify plan, tree
    walk, KV commit, drafting and tree build) must not make the host wait for
    the GPU: each runs under ``torch.cuda.set_sync_debug_mode("error")``,
    which raises at any synchronizing call (``.item()``, ``.cpu()``, a
    device-to-host copy, a boolean-mask index). The random drafter keeps the
    run free of the oracle's own host reads."""
    from vllm_ddtree.v1.sample.tree_rejection_sampler import TreeRejectionSampler
    from vllm_ddtree.v1.spec_decode.ddtree_proposer import DDTreeProposer
    from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin

    checked: set[str] = set()
    for owner, name in (
        (DDTreeModelRunnerMixin, "_plan_verify"),
        (DDTreeModelRunnerMixin, "_update_states_after_model_execute"),
        (DDTreeProposer, "propose"),
        (TreeRejectionSampler, "forward"),
    ):
        fail_on_host_sync(monkeypatch, owner, name, checked)
    spec = ddtree_config(fixtures.dense_drafter, 16)
    llm = _engine(fixtures.dense_target, False, spec=spec, async_scheduling=True)
    try:
        assert _generate(llm) == expected
    finally:
        shutdown_llm(llm)
    for name in ("_plan_verify", "_update_states_after_model_execute", "propose"):
        assert name in checked, name
    assert "forward" in checked  # the tree sampler's
