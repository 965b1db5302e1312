# SPDX-License-Identifier: Apache-2.0
"""DDTree on a CUDA GPU: greedy output equals no-spec (FlashAttention + the
Triton tree pass), with the oracle drafter so that trees accept.

Run on the device machine: ``python -m pytest tests/gpu -q``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from vllm import LLM, SamplingParams

from tests.oracle_drafter import Oracle, oracle_drafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[(31 * i + 7 * j) % 300 + 5 for j in range(3 + i)] for i in range(12)]


def _engine(fixtures, enforce_eager: bool, spec=None) -> LLM:
    return LLM(
        model=str(fixtures.dense_target),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=16,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.3,
        seed=0,
        speculative_config=spec,
    )


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params)]


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("budget", [8, 64])
def test_greedy_equals_no_spec_on_gpu(fixtures, enforce_eager, budget):
    llm = _engine(fixtures, enforce_eager)
    expected = _generate(llm)
    del llm
    gc.collect()
    oracle = Oracle({tuple(p): p + o for p, o in zip(PROMPTS, expected, strict=True)})
    spec = {
        "method": "ddtree",
        "model": str(fixtures.dense_drafter),
        "num_speculative_tokens": budget,
    }
    with oracle_drafter(oracle):
        llm = _engine(fixtures, enforce_eager, spec)
        assert _generate(llm) == expected
        del llm
        gc.collect()
