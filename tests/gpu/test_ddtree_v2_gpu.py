# SPDX-License-Identifier: Apache-2.0
"""DDTree on vLLM's V2 model runner (``ddtree.model_runner: "v2"``): greedy
output equals V2 no-spec output, eager and with CUDA graphs, at batch 12 and
1, with fixed budgets and with vLLM's batch-size schedule, and with
requests entering mid-run (mixed batches), and with chain steps at large
batches; a seeded T > 0 run equals seeded V2 no-spec token for token;
DDTree's step parts never make the host wait for the GPU.

Run on the device machine: ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import pytest
import torch
from vllm import LLM, SamplingParams

from tests.gpu import test_ddtree_engine_gpu as v1_engine_tests
from tests.gpu.test_ddtree_engine_gpu import ACCEPTED, MAX_TOKENS, PROMPTS
from tests.utils import (
    ddtree_config,
    ddtree_kernels_compiled,
    fail_on_host_sync,
    make_llm,
    metric,
    no_pageable_uploads,
    record_uniform_fills,
    shutdown_llm,
)

# The V1 engine tests' marks: GPU only.
pytestmark = v1_engine_tests.pytestmark

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"


@pytest.fixture(scope="module", autouse=True)
def v2_runner():
    """Every engine of this module on the V2 runner, the references too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        yield


def _engine(model, enforce_eager: bool, spec=None) -> LLM:
    return make_llm(
        model,
        enforce_eager=enforce_eager,
        max_num_seqs=16,
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.4,
        compilation_config=None if enforce_eager else {"backend": "eager"},
        speculative_config=spec,
    )


def _generate(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    requests = [{"prompt_token_ids": p} for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [
    SamplingParams(
        temperature=1.0 if i % 2 else 0.8,
        top_k=-1 if i % 2 else 20,
        seed=1000 + i,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
    )
    for i in range(len(PROMPTS))
]


@pytest.fixture(scope="module")
def expected(v2_runner, fixtures) -> dict[str, list[list[int]]]:
    llm = _engine(fixtures.dense_target, enforce_eager=False)
    try:
        return {"greedy": _generate(llm, GREEDY), "seeded": _generate(llm, SEEDED)}
    finally:
        shutdown_llm(llm)


@pytest.mark.parametrize(
    ("enforce_eager", "budget"), [(True, 8), (True, 64), (False, 16), (False, 64)]
)
def test_v2_greedy_equals_v2_no_spec(fixtures, expected, enforce_eager, budget):
    spec = ddtree_config(fixtures.dense_drafter, budget, model_runner="v2")
    llm = _engine(fixtures.dense_target, enforce_eager, spec)
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner
        before = metric(llm, ACCEPTED) or 0
        # The watch includes vLLM's DFlash input kernel: its tile follows the
        # longest query, and the first step's short prompts take one no tree
        # step takes.
        with ddtree_kernels_compiled() as compiled:
            assert _generate(llm, GREEDY) == expected["greedy"]
            accepted = metric(llm, ACCEPTED) - before
            assert _generate(llm, GREEDY, PROMPTS[:1]) == expected["greedy"][:1]
    finally:
        shutdown_llm(llm)
    # The start-up warm-up compiled every kernel variant the steps used.
    assert not compiled, compiled
    # DFlash drafts through the target's embedding and LM head, so even the
    # random fixture drafter's trees accept tokens (about one a step on the
    # CPU): the KV compaction and the depth positions ran.
    assert accepted > 0


def _greedy_and_tree_size(llm: LLM, prompts) -> tuple[list[list[int]], float]:
    """Greedy outputs of ``prompts`` and the mean size of the trees the run
    verified."""
    counters = (DRAFT_TOKENS, DRAFTS)
    before = [metric(llm, name) or 0 for name in counters]
    outputs = _generate(llm, GREEDY, prompts)
    tokens, drafts = (
        metric(llm, name) - start for name, start in zip(counters, before, strict=True)
    )
    return outputs, tokens / drafts


def test_v2_batch_size_schedule(fixtures, expected, monkeypatch):
    """vLLM's batch-size schedule on V2 (full CUDA graphs for every draft
    length): a lone request verifies its whole 64-node tree, 2 or more
    requests the first 8 nodes of theirs (a tree: nodes come best-first),
    each size through graph buffers of its own (a 9-node batch without them
    replayed the chain attention its graph was captured with)."""
    seen = record_uniform_fills(monkeypatch)
    spec = ddtree_config(fixtures.dense_drafter, 64, model_runner="v2")
    spec["num_speculative_tokens_per_batch_size"] = [(1, 1, 64), (2, 16, 8)]
    llm = _engine(fixtures.dense_target, False, spec)
    try:
        with ddtree_kernels_compiled() as compiled:
            alone, wide = _greedy_and_tree_size(llm, PROMPTS[:1])
            batched, narrow = _greedy_and_tree_size(llm, PROMPTS)
    finally:
        shutdown_llm(llm)
    # Both tree sizes' kernel variants were compiled at start-up (the walk
    # writes V2's int64 rows; a warm-up with V1's int32 rows missed them).
    assert not compiled, compiled
    assert alone == expected["greedy"][:1]
    assert batched == expected["greedy"]
    # Requests that finish first leave the last ones alone, with whole trees.
    assert wide == 64 and narrow < 16, (wide, narrow)
    assert seen["by_size"].keys() == {9, 65}, seen


def test_v2_seeded_samples_equal_v2_no_spec(fixtures, expected):
    spec = ddtree_config(fixtures.dense_drafter, 16, model_runner="v2")
    llm = _engine(fixtures.dense_target, False, spec)
    try:
        assert _generate(llm, SEEDED) == expected["seeded"]
    finally:
        shutdown_llm(llm)


def _steady_greedy(llm: LLM, batch: int) -> list[list[int]]:
    """Greedy outputs of the prompts run ``batch`` at a time, the next one
    entering as one finishes (as a server admits them)."""
    from benchmarks.bench_e2e import run_steady

    return run_steady(
        llm,
        lambda k: ({"prompt_token_ids": PROMPTS[k]}, GREEDY),
        batch=batch,
        enough=lambda submitted: submitted >= len(PROMPTS),
    )


def _step_parts():
    """DDTree's own parts of a V2 step, each a ``(class, method)``."""
    from vllm_ddtree.v1.worker.gpu.model_runner import DDTreeV2ModelRunner
    from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler import (
        TreeWalkSampler,
    )
    from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator import (
        DDTreeSpeculator,
    )

    return (
        (DDTreeV2ModelRunner, "_plan_verify"),
        (DDTreeV2ModelRunner, "_commit_path"),
        (TreeWalkSampler, "__call__"),
        (DDTreeSpeculator, "propose"),
    )


def test_pageable_uploads_are_caught():
    """The guard of the test below fires at an upload from pageable memory
    and lets a pinned one through."""
    with no_pageable_uploads():
        torch.arange(3).pin_memory().to("cuda", non_blocking=True)
        with pytest.raises(RuntimeError, match="pageable"):
            torch.arange(3).to("cuda")
        with pytest.raises(RuntimeError, match="pageable"):
            torch.empty(3, dtype=torch.long, device="cuda").copy_(torch.arange(3))


def test_v2_requests_entering_mid_run(fixtures, expected, monkeypatch):
    """Requests entering one by one as others finish (as a server admits
    them): most steps prefill a request beside the trees, which replays no
    full CUDA graph (attention eager, the tree metadata built for a mixed
    batch). Prompts of up to ``1 + B`` tokens (B = 8) are chain rows of the
    tree pass, longer ones run FlashAttention first: both kinds of step
    occur. Outputs stay no-spec's, and DDTree's parts of those steps, the
    tree attention's forward and metadata included, neither synchronise
    nor upload from pageable memory (each would make the host wait for the
    GPU, undoing async scheduling's overlap)."""
    from vllm_ddtree.v1.attention.backends.tree_attn import (
        TreeAttentionImplMixin,
        TreeMetadataBuilderMixin,
    )
    from vllm_ddtree.v1.worker import verify_plan

    attach = TreeMetadataBuilderMixin._attach_tree
    stage = verify_plan.stage_layout
    mixed, chained = [], []

    def counted_attach(self, metadata, common_attn_metadata, tree, buffers):
        mixed.append(tree is not None and not tree.covers_batch)
        return attach(self, metadata, common_attn_metadata, tree, buffers)

    def counted_stage(*args, **kwargs):
        layout = stage(*args, **kwargs)
        chained.append(layout.chain_rows)
        return layout

    monkeypatch.setattr(TreeMetadataBuilderMixin, "_attach_tree", counted_attach)
    monkeypatch.setattr(verify_plan, "stage_layout", counted_stage)
    ours = (
        (TreeAttentionImplMixin, "forward"),
        (TreeMetadataBuilderMixin, "_attach_tree"),
        *_step_parts()[:2],
    )
    checked: set[str] = set()
    spec = ddtree_config(fixtures.dense_drafter, 8, model_runner="v2")
    llm = _engine(fixtures.dense_target, False, spec)
    try:
        # The sampler and the drafter run vLLM's own code too: syncs only.
        for owner, name in _step_parts()[2:]:
            fail_on_host_sync(monkeypatch, owner, name, checked)
        for owner, name in ours:
            fail_on_host_sync(monkeypatch, owner, name, checked, pageable_uploads=True)
        outputs = _steady_greedy(llm, batch=3)
    finally:
        shutdown_llm(llm)
    assert outputs == expected["greedy"]
    assert sum(mixed) >= 2, "too few steps ran FlashAttention beside the trees"
    assert sum(chained) >= 2, "too few steps had prompts as chain rows"
    assert checked == {name for _, name in (*_step_parts(), *ours)}


def test_v2_step_parts_never_wait_for_the_gpu(fixtures, expected, monkeypatch):
    """V2 never learns a step's results on the host; DDTree's own parts of a
    step (the verify plan, the walk, the KV commit, drafting and the tree
    build) must not make it wait for them either: each serving call runs
    under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any
    synchronizing call (``.item()``, ``.cpu()``, a boolean-mask index)."""
    parts = _step_parts()
    checked: set[str] = set()
    spec = ddtree_config(fixtures.dense_drafter, 16, model_runner="v2")
    llm = _engine(fixtures.dense_target, False, spec)
    try:
        # Wrapped once the engine has started: start-up may synchronise.
        for owner, name in parts:
            fail_on_host_sync(monkeypatch, owner, name, checked)
        assert _generate(llm, GREEDY) == expected["greedy"]
    finally:
        shutdown_llm(llm)
    assert checked == {name for _, name in parts}


def test_v2_chain_steps(fixtures, expected, monkeypatch):
    """Chain steps (``ddtree.chain_from_batch_size`` 4, trees of 32 nodes
    below): the 12-prompt batch verifies DFlash chains of 15 with
    FlashAttention (full CUDA graphs captured for them, no tree buffers)
    and V2's rejection sampler, a lone request verifies trees, and with
    requests entering as others finish (4 in flight, fewer as the last
    ones finish) the steps cross between the two. Greedy outputs stay V2
    no-spec's and no DDTree kernel compiles while serving."""
    from vllm_ddtree.v1.worker.gpu.model_runner import DDTreeV2ModelRunner

    seen = record_uniform_fills(monkeypatch)
    decide = DDTreeV2ModelRunner._verifies_chains
    chain_steps: list[bool] = []

    def recorded(self, input_batch):
        chain_steps.append(decide(self, input_batch))
        return chain_steps[-1]

    monkeypatch.setattr(DDTreeV2ModelRunner, "_verifies_chains", recorded)
    spec = ddtree_config(
        fixtures.dense_drafter, 32, model_runner="v2", chain_from_batch_size=4
    )
    llm = _engine(fixtures.dense_target, False, spec)
    try:
        with ddtree_kernels_compiled() as compiled:
            batched = _generate(llm, GREEDY)
            batch_steps, chain_steps[:] = list(chain_steps), []
            alone = _generate(llm, GREEDY, PROMPTS[:1])
            alone_steps, chain_steps[:] = list(chain_steps), []
            steady = _steady_greedy(llm, batch=4)
    finally:
        shutdown_llm(llm)
    assert not compiled, compiled
    assert batched == expected["greedy"]
    assert alone == expected["greedy"][:1]
    assert steady == expected["greedy"]
    assert batch_steps.count(True) > 10, batch_steps
    assert alone_steps and not any(alone_steps), alone_steps
    assert True in chain_steps and False in chain_steps, chain_steps
    # The chains' uniform batches never went through tree buffers.
    assert 16 not in seen["by_size"], seen


def test_v2_chain_steps_are_dflash_steps(fixtures):
    """With chain steps at every batch size, DDTree's steps are stock
    DFlash's: the same drafts (each position's argmax), verified by V2's
    rejection sampler with the same keys, so seeded T > 0 outputs equal
    stock DFlash's (V2, 15 drafts) token for token. (Stock DFlash on V2 is
    the oracle here: its sampling is lossless rejection sampling, not
    seeded-equal to no-spec.)"""
    outputs = []
    for spec in (
        ddtree_config(
            fixtures.dense_drafter, 32, model_runner="v2", chain_from_batch_size=1
        ),
        {
            "method": "dflash",
            "model": str(fixtures.dense_drafter),
            "num_speculative_tokens": 15,
        },
    ):
        llm = _engine(fixtures.dense_target, False, spec)
        try:
            outputs.append(_generate(llm, SEEDED))
        finally:
            shutdown_llm(llm)
    assert outputs[0] == outputs[1]
