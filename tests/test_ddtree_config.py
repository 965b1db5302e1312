# SPDX-License-Identifier: Apache-2.0
"""Bad DDTree configs and requests fail with a message naming the field."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.utils import ddtree_config, make_llm, shutdown_llm
from vllm_ddtree.config import (
    DDTreeConfig,
    parse_user_options,
    validate_request,
)


def _spec(**overrides):
    spec = {"method": "ddtree", "model": "/some/drafter", "num_speculative_tokens": 8}
    spec.update(overrides)
    return {k: v for k, v in spec.items() if v is not None}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model": None}, "'model'"),
        ({"num_speculative_tokens": None}, "'num_speculative_tokens'"),
        ({"num_speculative_tokens": 0}, "'num_speculative_tokens'"),
        ({"num_speculative_tokens": -3}, "'num_speculative_tokens'"),
        ({"num_speculative_tokens": "8"}, "'num_speculative_tokens'"),
        ({"num_speculative_tokens": True}, "'num_speculative_tokens'"),
        ({"ddtree": {"spine": True}}, "'ddtree'"),
        ({"ddtree": [1]}, "'ddtree'"),
        ({"ddtree": {"force_spine": "yes"}}, "'ddtree.force_spine'"),
        ({"ddtree": {"adaptive_budget": 1}}, "'ddtree.adaptive_budget'"),
        ({"ddtree": {"max_depth": 0}}, "'ddtree.max_depth'"),
        ({"disable_padded_drafter_batch": True}, "'disable_padded_drafter_batch'"),
        ({"rejection_sample_method": "synthetic"}, "'rejection_sample_method'"),
        ({"draft_sample_method": "probabilistic"}, "'draft_sample_method'"),
    ],
)
def test_bad_speculative_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        parse_user_options(_spec(**overrides))


def test_good_config_becomes_dflash():
    spec = parse_user_options(_spec(ddtree={"force_spine": True}))
    assert spec["method"] == "dflash"
    assert spec["ddtree"] == {"force_spine": True}
    assert spec["num_speculative_tokens"] == 8


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(presence_penalty=0.5), "presence_penalty"),
        (SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
        (SamplingParams(min_tokens=3), "min_tokens"),
        (SamplingParams(logit_bias={3: 1.0}), "logit_bias"),
        (SamplingParams(logprobs=2), "logprobs"),
        (SamplingParams(extra_args={"ddtree_budget": 9}), r"\[0, 8\]"),
        (SamplingParams(extra_args={"ddtree_budget": -1}), "ddtree_budget"),
        (SamplingParams(extra_args={"ddtree_budget": "4"}), "ddtree_budget"),
    ],
)
def test_bad_request_is_rejected(params, message):
    with pytest.raises(ValueError, match=message):
        validate_request(params, DDTreeConfig(budget=8, max_depth=15))


def test_good_request_passes():
    params = SamplingParams(temperature=0.7, top_p=0.9, extra_args={"ddtree_budget": 3})
    validate_request(params, DDTreeConfig(budget=8, max_depth=15))


def _llm(fixtures, target, drafter, **kwargs):
    return make_llm(
        target,
        max_model_len=256,
        speculative_config=ddtree_config(drafter, 4),
        **kwargs,
    )


@pytest.mark.slow
def test_drafter_must_be_dflash(fixtures):
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        _llm(fixtures, fixtures.dense_target, fixtures.dense_target)


@pytest.mark.slow
def test_async_scheduling_is_refused(fixtures):
    with pytest.raises(ValueError, match="async_scheduling"):
        _llm(
            fixtures,
            fixtures.dense_target,
            fixtures.dense_drafter,
            async_scheduling=True,
        )


@pytest.mark.slow
def test_engine_keeps_serving_after_a_bad_request(fixtures):
    llm = _llm(fixtures, fixtures.dense_target, fixtures.dense_drafter)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate(prompt, SamplingParams(repetition_penalty=1.3))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8
    shutdown_llm(llm)
