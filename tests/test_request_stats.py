# SPDX-License-Identifier: Apache-2.0
"""Per-request DDTree stats (``vllm_ddtree.request_stats``) offline.

(The OpenAI ``metrics.ddtree`` object is checked in tests/test_serve.py.)
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.utils import ddtree_config, llm_engine, metric
from vllm_ddtree import request_stats
from vllm_ddtree.config import DDTreeConfig
from vllm_ddtree.v1.metrics.request_stats import (
    SETTINGS_ARG,
    attach,
    get_stats,
    observe,
    stamp_settings,
)

BUDGET = 16


class _Stats:
    """Stands in for vLLM's ``RequestStateStats``."""


def test_stamp_resolves_the_budget_without_touching_the_callers_dict():
    cfg = DDTreeConfig(budget=BUDGET, max_depth=15)
    user_args = {"ddtree_budget": 3, "other": 1}
    params = SamplingParams(extra_args=user_args)
    stamp_settings(params, cfg)
    assert params.extra_args[SETTINGS_ARG] == {"block_size": 16, "tree_budget": 3}
    assert params.extra_args["other"] == 1
    assert SETTINGS_ARG not in user_args
    default = SamplingParams()
    stamp_settings(default, cfg)
    assert default.extra_args[SETTINGS_ARG]["tree_budget"] == BUDGET


def test_rounds_count_outputs_after_the_first_token():
    params = SamplingParams()
    stamp_settings(params, DDTreeConfig(budget=8, max_depth=7))
    req_stats = _Stats()
    attach(req_stats, params)
    observe(req_stats, 1, is_prefilling=True)  # prefill: first token
    assert get_stats(req_stats).mean_acceptance_length is None
    for n in (4, 0, 2, 3):  # 0: a step without output for this request
        observe(req_stats, n, is_prefilling=False)
    stats = get_stats(req_stats)
    assert (stats.decode_rounds, stats.round_tokens) == (3, 9)
    assert stats.to_dict() == {
        "block_size": 8,
        "tree_budget": 8,
        "decode_rounds": 3,
        "mean_acceptance_length": 3.0,
    }


def test_requests_of_other_engines_get_no_stats():
    req_stats = _Stats()
    attach(req_stats, SamplingParams(extra_args={"ddtree_budget": 2}))
    observe(req_stats, 3, is_prefilling=False)
    assert get_stats(req_stats) is None


@pytest.mark.slow
def test_offline_request_stats_match_the_engine_counters(fixtures):
    spec = ddtree_config(fixtures.dense_drafter, BUDGET)
    with llm_engine(
        fixtures.dense_target, max_model_len=256, speculative_config=spec
    ) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7, 8]}
        greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        drafts = metric(llm, "vllm:spec_decode_num_drafts") or 0
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") or 0
        [out] = llm.generate(prompt, greedy)
        drafts = metric(llm, "vllm:spec_decode_num_drafts") - drafts
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted

        stats = request_stats(out)
        assert (stats.block_size, stats.tree_budget) == (16, BUDGET)
        # One tree per round; the tokens after the first are the rounds'.
        assert stats.decode_rounds == drafts > 0
        assert stats.round_tokens == len(out.outputs[0].token_ids) - 1
        # Each round commits its accepted drafts plus a bonus token; only the
        # last round can lose tokens to max_tokens.
        request_accepted = stats.round_tokens - stats.decode_rounds
        assert accepted - stats.block_size < request_accepted <= accepted
        assert 1.0 < stats.mean_acceptance_length <= stats.block_size

        budgets = [0, 2, None]
        outs = llm.generate(
            [prompt] * len(budgets),
            [
                SamplingParams(
                    temperature=0,
                    max_tokens=24,
                    ignore_eos=True,
                    extra_args=None if b is None else {"ddtree_budget": b},
                )
                for b in budgets
            ],
        )
        per_request = [request_stats(o) for o in outs]
        assert [s.tree_budget for s in per_request] == [0, 2, BUDGET]
        # Without a tree every round commits exactly the bonus token.
        assert per_request[0].mean_acceptance_length == 1.0
        assert per_request[0].decode_rounds == 23
