# SPDX-License-Identifier: Apache-2.0
"""With B=15 and the top-1 spine forced, a DDTree is exactly DFlash's chain.

Same drafter, same drafts, same verification outcome: the accepted-token
counters of stock ``dflash`` (15 drafts) and of this tree must be equal, step
for step in aggregate, and the outputs identical. This pins the DDTree
drafter's context handling (accepted path reordered to the front) to stock
DFlash's behaviour on real drafter predictions.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.utils import ddtree_config, dflash_config, make_llm, shutdown_llm

pytestmark = pytest.mark.slow

PROMPTS = [[(17 * i + 5 * j) % 300 + 5 for j in range(4 + i)] for i in range(8)]


def _run(fixtures, spec) -> tuple[list[list[int]], dict[str, int]]:
    llm = make_llm(
        fixtures.dense_target,
        max_model_len=256,
        max_num_seqs=8,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    counters = {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")
    }
    shutdown_llm(llm)
    return [list(o.outputs[0].token_ids) for o in outputs], counters


def test_forced_spine_tree_reproduces_dflash_chain(fixtures):
    drafter = fixtures.dense_drafter
    chain_out, chain = _run(fixtures, dflash_config(drafter, 15))
    tree_out, tree = _run(fixtures, ddtree_config(drafter, 15, force_spine=True))
    assert tree_out == chain_out
    # The fixture drafter really predicts: the comparison is not vacuous.
    assert chain["vllm:spec_decode_num_accepted_tokens"] > 0
    assert tree == chain
