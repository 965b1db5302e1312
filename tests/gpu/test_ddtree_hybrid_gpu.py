# SPDX-License-Identifier: Apache-2.0
"""DDTree on a hybrid (GDN) target on a CUDA GPU: greedy output equals
no-spec (same amplified-GDN fixture and oracle drafter as the CPU test).

Run on the device machine:
``python -m pytest tests/gpu/test_ddtree_hybrid_gpu.py -q -s``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from vllm import LLM

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.test_ddtree_hybrid import (  # noqa: F401
    _generate,
    _prompts,
    no_spec_reference,
    prefix_caching_check,
    target,
)
from tests.utils import ddtree_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _engine(model, enforce_eager: bool, spec=None, **kwargs) -> LLM:
    return LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
        mamba_ssm_cache_dtype="float32",
        # The default FlashInfer GDN prefill needs CuTe-DSL.
        additional_config={"gdn_prefill_backend": "triton"},
        seed=0,
        speculative_config=spec,
        **kwargs,
    )


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("budget", [1, 8, 64])
def test_hybrid_greedy_equals_no_spec_on_gpu(fixtures, target, enforce_eager, budget):  # noqa: F811
    prompts = _prompts()
    llm = _engine(target, enforce_eager)
    expected = no_spec_reference(llm, prompts)
    del llm
    gc.collect()
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, expected, strict=True)})
    spec = ddtree_config(fixtures.hybrid_drafter, budget)
    with oracle_drafter(oracle):
        llm = _engine(target, enforce_eager, spec)
        for batch, subset in ((8, len(prompts)), (1, 3)):
            got = _generate(llm, prompts[:subset], batch)
            for i, (want, have) in enumerate(zip(expected, got, strict=False)):
                assert have[: len(want)] == want, f"prompt {i}, batch {batch}"
        del llm
        gc.collect()


def test_hybrid_prefix_caching_on_gpu(fixtures, target, monkeypatch):  # noqa: F811
    def make(speculative_config=None) -> LLM:
        return _engine(target, False, speculative_config, enable_prefix_caching=True)

    prefix_caching_check(fixtures, make, monkeypatch)
