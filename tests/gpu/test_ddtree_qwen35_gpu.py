# SPDX-License-Identifier: Apache-2.0
"""DDTree on a Qwen3.5 (M-RoPE, GDN) target on a CUDA GPU: greedy output
equals no-spec up to near-ties (the CPU test's model and oracle drafter,
eager engines). A divergence is reported with both runs' top-3
log-probabilities, which tell a shifted near-tie from a wrong state or
position.

Run on the device machine:
``python -m pytest tests/gpu/test_ddtree_qwen35_gpu.py -q -s``.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_ddtree_hybrid_gpu import _greedy_top3, tree_divergences
from tests.oracle_drafter import Oracle, oracle_drafter
from tests.test_ddtree_qwen35 import (  # noqa: F401
    ENGINE_ARGS,
    RANKS,
    _prompts,
    models,
    qwen35_engine,
    qwen35_reference,
)
from tests.utils import ddtree_config, make_llm, metric, shutdown_llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The default FlashInfer GDN prefill needs CuTe-DSL.
GPU_ARGS = dict(
    enforce_eager=True,
    gpu_memory_utilization=0.3,
    additional_config={"gdn_prefill_backend": "triton"},
)


@pytest.fixture(scope="module")
def reference(models):  # noqa: F811
    """No-spec outputs cut before their first near-tie, and every output
    position's top-3 log-probabilities."""
    prompts = _prompts()
    llm = qwen35_engine(models[0], **GPU_ARGS)
    try:
        cut = qwen35_reference(llm)
        top = [top for _, top in _greedy_top3(llm, prompts, len(prompts))]
    finally:
        shutdown_llm(llm)
    return cut, top


# Both scheduling modes, set explicitly: on a GPU vLLM schedules fixed-budget
# engines asynchronously unless told otherwise (the first GPU run of this
# test, 2026-12-06, went through the CPU test's helper, which asserts
# synchronous scheduling, and failed both cases).
@pytest.mark.parametrize(
    ("ranks", "scheduling"), [("first", "sync"), ("second", "async")]
)
def test_qwen35_greedy_equals_no_spec_gpu(models, reference, ranks, scheduling):  # noqa: F811
    target, drafter = models
    prompts = _prompts()
    expected, expected_top = reference
    sequences = {tuple(p): p + o for p, o in zip(prompts, expected, strict=True)}
    with oracle_drafter(Oracle(sequences, RANKS[ranks])):
        llm = make_llm(
            target,
            speculative_config=ddtree_config(drafter, 8),
            skip_tokenizer_init=True,
            async_scheduling=scheduling == "async",
            **ENGINE_ARGS,
            **GPU_ARGS,
        )
        failures = tree_divergences(llm, prompts, expected, expected_top)
        tau = 1 + metric(llm, "vllm:spec_decode_num_accepted_tokens") / metric(
            llm, "vllm:spec_decode_num_drafts"
        )
        shutdown_llm(llm)
    assert not failures, "\n".join(failures)
    print(f"\n[qwen3.5 gpu, {ranks} siblings, {scheduling}] tau {tau:.2f}")
