# SPDX-License-Identifier: Apache-2.0
"""DDTree on a Qwen3.5 (M-RoPE, GDN) target on a CUDA GPU: greedy output
equals no-spec up to near-ties (the CPU test's model and oracle drafter,
eager engines).

Run on the device machine:
``python -m pytest tests/gpu/test_ddtree_qwen35_gpu.py -q -s``.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_ddtree_qwen35 import (  # noqa: F401
    NUM_PROMPTS,
    RANKS,
    _ddtree_run,
    _mismatches,
    models,
    qwen35_reference,
)

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
    return qwen35_reference(models[0], **GPU_ARGS)


@pytest.mark.parametrize("ranks", list(RANKS))
def test_qwen35_greedy_equals_no_spec_gpu(models, reference, ranks):  # noqa: F811
    results, tau = _ddtree_run(
        models, reference, ((8, NUM_PROMPTS), (1, 3)), RANKS[ranks], **GPU_ARGS
    )
    for batch, got in results.items():
        assert not _mismatches(reference[: len(got)], got), f"batch {batch}"
    print(f"\n[qwen3.5 gpu, {ranks} siblings] tau {tau:.2f}")
