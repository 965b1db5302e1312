# SPDX-License-Identifier: Apache-2.0
"""An exact oracle for sampled DDTree output on the CPU.

DDTree draws every token by Gumbel-max keyed by (request seed, position)
(``vllm_ddtree/v1/sample/keyed_gumbel.py``), so a seeded request's tokens
depend only on the target's logits along its own sequence. vLLM's own CPU
sampler draws from a per-request generator instead; inside
:func:`keyed_no_spec_sampling` in-process no-spec engines draw keyed too,
and a seeded DDTree output must then equal the no-spec one token for token,
up to bf16 near-ties of the noisy scores (:func:`sampled_reference`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple
from unittest.mock import patch

import torch
from vllm import LLM, SamplingParams
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.greedy_ties import TIE
from vllm_ddtree.v1.sample.keyed_gumbel import keyed_uniform
from vllm_ddtree.v1.sample.tree_rejection_sampler import PositionSeededTopKTopP


@contextmanager
def keyed_no_spec_sampling() -> Iterator[None]:
    """vLLM's V1 runners (GPU and CPU) publish every step's sampled
    positions to a :class:`PositionSeededTopKTopP` stage, as DDTree's runner
    does for its draft-less steps. Meant for no-spec engines."""
    prepare = GPUModelRunner._prepare_inputs

    def keyed_prepare(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_metadata = prepare(
            self, scheduler_output, num_scheduled_tokens
        )
        assert spec_metadata is None, "for engines without speculation"
        stage = self.sampler.topk_topp_sampler
        if not isinstance(stage, PositionSeededTopKTopP):
            stage = PositionSeededTopKTopP(stage, use_fp64_gumbel=False)
            self.sampler.topk_topp_sampler = stage
        stage.positions = self.positions[logits_indices]
        return logits_indices, spec_metadata

    with patch.object(GPUModelRunner, "_prepare_inputs", keyed_prepare):
        yield


def seeded_params(
    num: int, temperature: float, max_tokens: int, **kw
) -> list[SamplingParams]:
    """Sampling parameters of request ``i``: seed ``1000 + i``."""
    return [
        SamplingParams(
            temperature=temperature,
            seed=1000 + i,
            max_tokens=max_tokens,
            ignore_eos=True,
            **kw,
        )
        for i in range(num)
    ]


def noisy_scores(
    logprobs: dict, seed: int, position: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their keyed Gumbel-max scores (``logprob / T`` plus the
    noise of ``(seed, position)``) from one position's full logprobs."""
    ids = torch.tensor(list(logprobs))
    lp = torch.tensor([x.logprob for x in logprobs.values()], dtype=torch.float64)
    u = keyed_uniform(
        torch.tensor([seed]), torch.tensor([position]), int(ids.max()) + 1
    )
    return ids, lp / temperature - torch.log(-torch.log(u[0, ids]))


class SampledReference(NamedTuple):
    """Keyed no-spec samples (see :func:`sampled_reference`)."""

    whole: list[list[int]]
    cut: list[list[int]]
    # Per token: the gap between the two best noisy scores, times T (in
    # log-probability units, like :data:`TIE`).
    gaps: list[list[float]]


def sampled_reference(
    llm: LLM,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    min_fraction: float,
) -> SampledReference:
    """Keyed no-spec samples of ``llm`` (made inside
    :func:`keyed_no_spec_sampling`, ``max_logprobs=-1``): whole, each cut
    before the first token whose two best noisy scores are within
    :data:`TIE` / T (there a batched verify may round the other way; past it
    the continuations are different but equally valid samples), and every
    token's gap.

    Every token off a near-tie must be the best noisy score's: a check that
    the engine really drew keyed samples. Ties must stay rare, or the
    comparison would prove little: at least ``min_fraction`` of the tokens
    are kept.
    """
    full = [p.clone() for p in params]
    for p in full:
        p.logprobs = -1
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], full, use_tqdm=False
    )
    ref = SampledReference([], [], [])
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        ids = list(out.outputs[0].token_ids)
        gaps = []
        for i, logprobs in enumerate(out.outputs[0].logprobs):
            tokens, scores = noisy_scores(
                logprobs, p.seed, len(prompt) + i - 1, p.temperature
            )
            best = scores.topk(2)
            # A logprob's rounding error is scaled by 1 / T in the scores.
            gaps.append(float(best.values[0] - best.values[1]) * p.temperature)
            if gaps[-1] >= TIE:
                assert tokens[best.indices[0]] == ids[i], "no-spec did not sample keyed"
        keep = next((i for i, gap in enumerate(gaps) if gap < TIE), len(ids))
        ref.whole.append(ids)
        ref.cut.append(ids[:keep])
        ref.gaps.append(gaps)
    kept, total = sum(map(len, ref.cut)), sum(map(len, ref.whole))
    assert kept > min_fraction * total, (kept, total)
    return ref
