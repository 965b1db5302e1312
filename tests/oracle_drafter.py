# SPDX-License-Identifier: Apache-2.0
"""A test drafter that knows the answer, with controlled mistakes.

Random fixture drafters accept (almost) nothing, which would leave the
accept / compact / reorder paths of DDTree untested. This oracle replaces the
DFlash drafter's log-probabilities (in-process engines only) so that, at
depth ``d`` of a request whose next token is at sequence index ``i``, the
reference token ``ref[i + d]`` gets a random rank among the first few entries
(sometimes no rank at all). Trees then accept long paths through first and
later siblings, and stop at random depths. The target still decides every
token, so outputs must equal no-spec decoding whatever the oracle does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from vllm_ddtree.v1.spec_decode.ddtree_proposer import DDTreeProposer
from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin


class Oracle:
    """Reference continuations keyed by prompt, and the mistake model.

    Args:
        sequences: prompt token ids -> full reference sequence (prompt plus
            the no-spec greedy output).
        rank_weights: probability of the reference token taking rank 0, 1,
            ...; the remaining mass puts it outside the drafter's top-k.
        seed: seeds the ranks, per (sequence, index, depth).
    """

    def __init__(
        self,
        sequences: dict[tuple[int, ...], Sequence[int]],
        rank_weights: Sequence[float] = (0.6, 0.2, 0.1),
        seed: int = 0,
    ) -> None:
        self.sequences = {k: list(v) for k, v in sequences.items()}
        self.rank_weights = list(rank_weights)
        self.seed = seed

    def rank(self, key: int, index: int, depth: int) -> int | None:
        g = torch.Generator().manual_seed(
            hash((self.seed, key, index, depth)) % (2**31)
        )
        u = float(torch.rand((), generator=g))
        for rank, w in enumerate(self.rank_weights):
            if u < w:
                return rank
            u -= w
        return None

    def logits(
        self, prompt: tuple[int, ...], next_index: int, depth: int, vocab: int
    ) -> torch.Tensor:
        """Drafter logits ``[depth, vocab]`` for one request."""
        seq = self.sequences.get(prompt)
        key = hash(prompt) % (2**31)
        g = torch.Generator().manual_seed((key * 1_000_003 + next_index) % (2**31))
        logits = torch.randn(depth, vocab, generator=g)
        if seq is None:
            return logits
        for d in range(depth):
            index = next_index + 1 + d
            if index >= len(seq):
                break
            rank = self.rank(key, index, d)
            if rank is None:
                logits[d, seq[index]] = -1e4
                continue
            order = logits[d].argsort(descending=True).tolist()
            order.remove(seq[index])
            order.insert(rank, seq[index])
            # Clearly decreasing logits in that order: a bushy but deep tree.
            logits[d, torch.tensor(order)] = -1.5 * torch.arange(vocab).float()
        return logits


@contextmanager
def oracle_drafter(oracle: Oracle) -> Iterator[None]:
    """Make every DDTreeProposer in this process draft from ``oracle``."""
    original_runner_propose = DDTreeModelRunnerMixin.propose_draft_token_ids
    original_propose = DDTreeProposer.propose
    original_sample = DDTreeProposer._sample_draft_tokens

    def runner_propose(self, *args, **kwargs):
        # Tell the drafter which prompt each batch row belongs to.
        self.drafter._oracle_prompts = [
            tuple(self.requests[req_id].prompt_token_ids)
            for req_id in self.input_batch.req_ids
        ]
        return original_runner_propose(self, *args, **kwargs)

    def propose(self, *args, **kwargs):
        # Index of each request's root (the bonus token) in its sequence:
        # the tokens with valid KV before it.
        cm = kwargs["common_attn_metadata"]
        rejected = kwargs.get("num_rejected_tokens_gpu")
        seq_lens = cm.seq_lens[: cm.num_reqs].cpu()
        if rejected is not None:
            seq_lens = seq_lens - rejected[: cm.num_reqs].cpu()
        self._oracle_next_index = seq_lens.tolist()
        return original_propose(self, *args, **kwargs)

    def sample(self, hidden_states, sampling_metadata):
        real = self.model.compute_logits(hidden_states)
        depth = self.ddtree.max_depth
        rows = []
        for prompt, next_index in zip(
            self._oracle_prompts, self._oracle_next_index, strict=True
        ):
            rows.append(oracle.logits(prompt, next_index, depth, real.shape[-1]))
        fake = torch.cat(rows).to(real)
        self.model.compute_logits = lambda _h, _real=fake: _real
        try:
            return original_sample(self, hidden_states, sampling_metadata)
        finally:
            del self.model.compute_logits

    DDTreeModelRunnerMixin.propose_draft_token_ids = runner_propose
    DDTreeProposer.propose = propose
    DDTreeProposer._sample_draft_tokens = sample
    try:
        yield
    finally:
        DDTreeModelRunnerMixin.propose_draft_token_ids = original_runner_propose
        DDTreeProposer.propose = original_propose
        DDTreeProposer._sample_draft_tokens = original_sample
