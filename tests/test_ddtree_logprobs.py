# SPDX-License-Identifier: Apache-2.0
"""Sample and prompt logprobs under DDTree (CPU engines).

Every output token of a tree step was chosen at one node of the accepted
path, so its logprobs are that node's. Greedy: tokens and logprobs equal
no-spec decoding's. Sampled (T > 0, different tokens than no-spec): each
returned logprob equals the one a no-spec engine assigns to the same token
after the same prefix (its prompt logprobs over prompt + output). The oracle
drafter makes trees accept paths through later siblings, so the mapping
from output columns to nodes is exercised.
"""

from __future__ import annotations

import math

import pytest
from vllm import LLM, SamplingParams

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.utils import cpu_async_scheduling, ddtree_config, make_llm, shutdown_llm

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
# Verification batches tree rows where no-spec decodes one token: bf16
# logits may round differently (about 0.03 in logprob on this model).
TOL = 0.08


def _prompts() -> list[list[int]]:
    return [[(29 * i + 13 * j) % 300 + 5 for j in range(3 + i)] for i in range(8)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    requests = [{"prompt_token_ids": p} for p in prompts]
    return [o for o in llm.generate(requests, params, use_tqdm=False)]


def _close(got: dict, want: dict, where: str) -> None:
    """Same top tokens (up to near-ties) and logprobs within ``TOL``."""
    for token, lp in want.items():
        if token in got:
            assert math.isclose(got[token].logprob, lp.logprob, abs_tol=TOL), where
        else:  # a near-tie at the edge of the top-k
            assert min(x.logprob for x in want.values()) + TOL > lp.logprob, where


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_logprobs_equal_no_spec(fixtures, scheduling):
    prompts = _prompts()
    greedy = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3,
        prompt_logprobs=2,
    )  # fmt: skip
    sampled = SamplingParams(
        temperature=0.8, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True,
        logprobs=1, seed=7,
    )  # fmt: skip

    llm = make_llm(fixtures.dense_target)
    reference = _run(llm, prompts, greedy)
    shutdown_llm(llm)

    oracle = Oracle(
        {
            tuple(p): p + list(o.outputs[0].token_ids)
            for p, o in zip(prompts, reference, strict=True)
        }
    )
    # vLLM copies an async step's logprobs to the host a step late.
    with oracle_drafter(oracle), cpu_async_scheduling():
        llm = make_llm(
            fixtures.dense_target,
            speculative_config=ddtree_config(fixtures.dense_drafter, 8),
            async_scheduling=scheduling == "async",
        )
        got = _run(llm, prompts, greedy)
        samples = _run(llm, prompts, sampled)
        shutdown_llm(llm)

    for i, (want, have) in enumerate(zip(reference, got, strict=True)):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids, i
        for j, (w, h) in enumerate(
            zip(want.outputs[0].logprobs, have.outputs[0].logprobs, strict=True)
        ):
            _close(h, w, f"prompt {i}, token {j}")
        for j, (w, h) in enumerate(
            zip(want.prompt_logprobs, have.prompt_logprobs, strict=True)
        ):
            if w is not None:
                _close(h, w, f"prompt {i}, prompt token {j}")

    # Score the sampled outputs with no-spec prompt logprobs.
    sequences = [
        p + list(o.outputs[0].token_ids) for p, o in zip(prompts, samples, strict=True)
    ]
    llm = make_llm(fixtures.dense_target)
    scored = _run(llm, sequences, SamplingParams(max_tokens=1, prompt_logprobs=0))
    shutdown_llm(llm)
    for i, (prompt, sample, score) in enumerate(
        zip(prompts, samples, scored, strict=True)
    ):
        out = sample.outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == MAX_TOKENS
        for j, (token, lps) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            want = score.prompt_logprobs[len(prompt) + j][token].logprob
            assert math.isclose(lps[token].logprob, want, abs_tol=TOL), (i, j)
