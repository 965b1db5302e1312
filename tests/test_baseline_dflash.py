# SPDX-License-Identifier: Apache-2.0
"""Baseline: stock vLLM DFlash vs no speculation on the fixture models.

Greedy outputs must be token-identical (dense target). This pins down that
the fixtures, the CPU engine setup and stock DFlash agree before DDTree is
involved, and records stock DFlash's acceptance on the fixture drafters.

For the hybrid (GDN) target the same comparison only records the result:
stock DFlash on Qwen3-Next style hybrids is a known stock-vLLM problem (it
can diverge from non-speculative decoding), so that test is a non-strict
xfail.

Engines run in-process (see ``tests/utils.py``); each module-scoped fixture
starts the two engines of one target one after the other and shuts each down
before the next starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from vllm import SamplingParams

from tests.utils import dflash_config, llm_engine, metric, reset_vllm_state

pytestmark = pytest.mark.slow

PROMPTS = [
    "The little harbour town",
    "A computer is a machine that",
    "What is the capital of France?",
    "Once upon a time",
    "Speculative decoding lets a small draft model",
    "Hello world",
    "1 2 3 4 5",
    "The teacher kept a jar of coloured pencils on her desk and a map of",
]
MAX_TOKENS = 48


@dataclass
class Run:
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] | None = None


def _run(model, speculative_config=None) -> Run:
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0
    )
    with llm_engine(model, speculative_config=speculative_config) as llm:
        names = (
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
        )
        before = [metric(llm, n) or 0 for n in names]
        before_pos = metric(llm, "vllm:spec_decode_num_accepted_tokens_per_pos")
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        after = [metric(llm, n) or 0 for n in names]
        per_pos = metric(llm, "vllm:spec_decode_num_accepted_tokens_per_pos")
    if per_pos is not None and before_pos is not None:
        per_pos = [a - b for a, b in zip(per_pos, before_pos, strict=False)]
    run = Run(
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        logprobs=[
            [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
            for o in outputs
        ],
        accepted_per_pos=per_pos,
    )
    run.drafts, run.draft_tokens, run.accepted = (
        a - b for a, b in zip(after, before, strict=True)
    )
    return run


def _compare(name: str, base: Run, spec: Run) -> tuple[list[int | None], float]:
    """Print a summary; return per-prompt first divergence and max |dlogprob|
    over the common prefixes."""
    first_diff: list[int | None] = []
    max_dlp = 0.0
    for ref, got, ref_lp, got_lp in zip(
        base.token_ids, spec.token_ids, base.logprobs, spec.logprobs, strict=True
    ):
        pairs = zip(ref, got, strict=False)
        diff = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        first_diff.append(diff)
        same = min(len(ref), len(got)) if diff is None else diff
        for a, b in zip(ref_lp[:same], got_lp[:same], strict=True):
            max_dlp = max(max_dlp, abs(a - b))
    per_draft = spec.accepted / spec.drafts if spec.drafts else 0.0
    print(
        f"\n[{name}] stock dflash vs no-spec: first divergence per prompt "
        f"{first_diff}, max |dlogprob| {max_dlp:.2e}; drafts {spec.drafts}, "
        f"accepted {spec.accepted} ({per_draft:.2f}/draft), "
        f"per position {spec.accepted_per_pos}"
    )
    return first_diff, max_dlp


@pytest.fixture(scope="module")
def dense_runs(fixtures):
    reset_vllm_state()  # in case an earlier module left an engine behind
    base = _run(fixtures.dense_target)
    spec = _run(fixtures.dense_target, dflash_config(fixtures.dense_drafter))
    return base, spec


def test_dense_dflash_greedy_matches_no_spec(dense_runs):
    base, spec = dense_runs
    assert all(len(t) == MAX_TOKENS for t in base.token_ids)
    first_diff, max_dlp = _compare("dense", base, spec)
    assert first_diff == [None] * len(PROMPTS)
    # On CPU the two paths agree bit for bit here; allow kernel-level noise.
    assert max_dlp < 0.05


def test_dense_dflash_accepts_drafts(dense_runs):
    """The fixture drafter is built to get ~1 of 15 drafts per step accepted
    (first position ~65%, second ~25%, later ones never)."""
    _, spec = dense_runs
    assert spec.drafts > 0
    assert spec.draft_tokens == 15 * spec.drafts
    assert 0.5 < spec.accepted / spec.drafts < 1.5
    assert spec.accepted_per_pos is not None
    assert spec.accepted_per_pos[0] > spec.accepted_per_pos[1] > 0


@pytest.mark.xfail(
    strict=False,
    reason="known stock-vLLM issue: DFlash on hybrid (GDN/mamba-state) targets "
    "can diverge from non-speculative greedy decoding; recorded, not required",
)
def test_hybrid_dflash_greedy_matches_no_spec(fixtures):
    reset_vllm_state()
    base = _run(fixtures.hybrid_target)
    spec = _run(fixtures.hybrid_target, dflash_config(fixtures.hybrid_drafter))
    assert all(len(t) == MAX_TOKENS for t in base.token_ids)
    first_diff, _ = _compare("hybrid", base, spec)
    assert first_diff == [None] * len(PROMPTS)
