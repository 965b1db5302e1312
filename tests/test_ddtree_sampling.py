# SPDX-License-Identifier: Apache-2.0
"""DDTree at temperature > 0 samples the target's distribution exactly.

Compared with no-spec sampling (not with stock DFlash, whose CPU rejection
path is biased): the distribution of each generated position, over many
samples of one prompt, must be the same. Temperature 2 (``top_k=50``, so
the top-k path runs too) spreads the fixture's peaked logits over enough
categories for a chi-square test to have power; the oracle
drafter makes trees accept, so later positions really come from tree walks.
Half of the requests carry seeds, which exercises per-request generators.
"""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chi2_contingency
from vllm import LLM, SamplingParams

from tests.keyed_sampling import (
    keyed_no_spec_sampling,
    sampled_reference,
    seeded_params,
)
from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import ddtree_config, make_llm, metric, shutdown_llm

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 33]
NUM_SAMPLES = 800
MAX_TOKENS = 4


def _samples(llm: LLM, temperature: float, top_k: int) -> list[list[int]]:
    requests = [{"prompt_token_ids": PROMPT}] * NUM_SAMPLES
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            seed=1000 + i if i % 2 else None,
        )
        for i in range(NUM_SAMPLES)
    ]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _engine(fixtures, speculative_config=None) -> LLM:
    return make_llm(
        fixtures.dense_target,
        max_model_len=256,
        max_num_seqs=64,
        speculative_config=speculative_config,
    )


def _homogeneity_pvalue(a: list[int], b: list[int]) -> float:
    """Chi-square two-sample test; rare categories (< 10 pooled) merged."""
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    common = [t for t, n in pooled.items() if n >= 10]
    rows = [[c[t] for t in common] for c in (ca, cb)]
    for row, c in zip(rows, (ca, cb), strict=True):
        row.append(sum(n for t, n in c.items() if t not in common))
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return float(chi2_contingency(rows).pvalue)


def test_tree_walk_samples_the_target_distribution(fixtures):
    temperature, top_k = 2.0, 50
    llm = _engine(fixtures)
    reference = _samples(llm, temperature, top_k)
    greedy = (
        llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    shutdown_llm(llm)

    spec = ddtree_config(fixtures.dense_drafter, 8)
    with oracle_drafter(Oracle({tuple(PROMPT): PROMPT + list(greedy)})):
        llm = _engine(fixtures, spec)
        samples = _samples(llm, temperature, top_k)
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        shutdown_llm(llm)
    assert accepted > NUM_SAMPLES // 10, "trees must accept for the test to mean much"

    for pos in range(MAX_TOKENS):
        ref_tokens = [s[pos] for s in reference]
        # The test has power only if the position is really random.
        assert Counter(ref_tokens).most_common(1)[0][1] < 0.95 * NUM_SAMPLES
        p = _homogeneity_pvalue(ref_tokens, [s[pos] for s in samples])
        assert p > 1e-3, f"position {pos}: DDTree and no-spec differ (p={p:.2e})"


def test_seeded_samples_equal_keyed_no_spec(fixtures):
    """Every sample is keyed by (seed, position), so a seeded request's
    tokens are the keyed no-spec ones, token for token up to near-ties,
    whatever its trees accepted (tests/keyed_sampling.py). Requests are
    seeded; the oracle follows the no-spec samples, so trees accept deep
    paths and the accepted paths' KV is compacted at every step."""
    prompts = [
        [(29 * i + 7 * j) % 300 + 5 for j in range(3 + i % 9)] for i in range(24)
    ]
    params = seeded_params(len(prompts), 1.0, 32)
    with keyed_no_spec_sampling():
        llm = make_llm(fixtures.dense_target, max_logprobs=-1, max_num_seqs=8)
        whole, cut, _ = sampled_reference(llm, prompts, params, min_fraction=0.1)
        shutdown_llm(llm)
    oracle = Oracle({tuple(p): p + o for p, o in zip(prompts, whole, strict=True)})
    with oracle_drafter(oracle):
        llm = make_llm(
            fixtures.dense_target,
            max_num_seqs=8,
            speculative_config=ddtree_config(fixtures.dense_drafter, 64),
        )
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        drafts = metric(llm, "vllm:spec_decode_num_drafts")
        accepted = metric(llm, "vllm:spec_decode_num_accepted_tokens")
        shutdown_llm(llm)
    for i, (want, out) in enumerate(zip(cut, outputs, strict=True)):
        assert list(out.outputs[0].token_ids)[: len(want)] == want, f"prompt {i}"
    assert accepted / drafts > 1.0, "trees must accept deep paths"
