# SPDX-License-Identifier: Apache-2.0
"""Tree verification on vLLM's V2 model runner.

V2's :class:`RejectionSampler` checks a chain. Here the target's token at
every node is drawn by V2's own :class:`Sampler` (temperature, min-p, top-k /
top-p, then a Gumbel-max draw keyed by the request's seed and the node's
position, which the runner has made the node's depth position), so a node's
choice is exactly the token V2 would sample without speculation after the
node's prefix; :func:`walk_trees_triton` then follows those choices down
each tree. No draft probabilities are involved (lossless at any
temperature, see ``v1/sample/tree_rejection_sampler.py``).

The output keeps V2's format: ``sampled [num_reqs, 1 + min(B,
max_depth)]`` (the accepted path's tokens, then the bonus token) and
``num_sampled`` (path length + 1), from which V2 derives ``num_rejected``,
advances each request's computed tokens and feeds the drafter. Logprobs
are computed on the logit rows put in path order (each request's accepted
nodes first), which is the layout V2's chain logprobs have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.worker.gpu.input_batch import InputBatch, get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit
from vllm_ddtree.v1.ops.triton_tree_cores import PathFirstOrder, walk_trees_triton
from vllm_ddtree.v1.ops.triton_verify_step import path_first_targets
from vllm_ddtree.v1.spec_decode.tree import WalkResult, path_first_permutation
from vllm_ddtree.v1.worker.verify_plan import StagedLayout

# The dtype of V2's sampler-output rows, which the walk writes.
SAMPLED_TOKEN_DTYPE = torch.int64


@dataclass
class TreeWalkInput:
    """The trees of the current verify batch, published by the runner:
    ``parents [num_reqs, W]`` (root column and padding ``-1``), the batch
    layout, the bound on every node's depth, the position buffer whose
    depth positions the walk's launch turns back into linear ones and,
    where the runner has one, the accepted paths' KV commit for the walk's
    launch to make (see :func:`walk_trees_triton`)."""

    parents: torch.Tensor
    layout: StagedLayout
    max_depth: int
    positions: torch.Tensor
    kv_commit: tuple[SlotRowsCommit, torch.Tensor] | None = None


@dataclass
class WalkedTrees:
    """A verify step's walk and, written by the same launch, the token order
    that puts each accepted path first (the drafter reads the target's
    hidden states in it); ``kv_committed``: the launch also moved the
    accepted paths' KV."""

    walk: WalkResult
    path_first: PathFirstOrder
    kv_committed: bool


class TreeWalkSampler(RejectionSampler):
    def __init__(
        self, sampler, spec_config, device: torch.device, max_depth: int
    ) -> None:
        super().__init__(sampler, spec_config, device)
        # A path (or a chain, see __call__) accepts at most min(B, max_depth)
        # nodes, then the bonus: V2 reads rows through their stride and
        # ``num_sampled``, so the rows need no column per node of the budget
        # (a row of 1 + B columns costs the step's device-to-host copy and
        # V2's host-side lists). V2's rejection sampling sizes its rows by
        # ``num_speculative_steps``.
        self.num_speculative_steps = min(self.num_speculative_steps, max_depth)
        self.num_columns = self.num_speculative_steps + 1
        self.step: TreeWalkInput | None = None
        self.last_walk: WalkedTrees | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        input_batch: InputBatch,
        draft_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        step, self.step = self.step, None
        if step is None:
            # A chain step (``ddtree.chain_from_batch_size``): the runner
            # published no trees and V2's rejection sampling checks the
            # chains.
            return super().__call__(logits, input_batch, draft_logits)
        num_nans = get_num_nans(logits) if self.sampler.compute_nans else None
        # The token of every logit row: the root's or a node's.
        row_tokens = input_batch.input_ids[input_batch.logits_indices]
        return_logprobs = self.sampler.returns_logprobs(input_batch.idx_mapping_np)
        choices, processed = self.sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            input_batch.positions[input_batch.logits_indices],
            row_tokens,
            input_batch.expanded_local_pos,
            return_logprobs=return_logprobs,
        )
        layout = step.layout
        width = layout.logit_rows.shape[1]
        sampled = torch.full(
            (input_batch.num_reqs, self.num_columns),
            -1,
            dtype=SAMPLED_TOKEN_DTYPE,
            device=logits.device,
        )
        path_first = path_first_targets(
            layout, input_batch.num_tokens_after_padding, step.positions
        )
        # Every logit row's token and choice, read at each node's row.
        walk = walk_trees_triton(
            row_tokens,
            step.parents[:, :width],
            layout.num_nodes,
            choices,
            step.max_depth,
            sampled,
            token_rows=layout.logit_rows,
            target_rows=layout.logit_rows,
            path_first=path_first,
            kv_commit=step.kv_commit,
        )
        self.last_walk = WalkedTrees(walk, path_first, step.kv_commit is not None)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (walk.num_accepted + 1).to(torch.int32),
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            self.sampler.req_states.prefill_len.gpu,
        )
        logprobs = None
        if return_logprobs:
            source = (
                processed
                if self.sampler.logprobs_mode
                in ("processed_logprobs", "processed_logits")
                else logits
            )
            logprobs = self._get_logprobs_tensors(
                input_batch,
                sampled,
                num_sampled,
                source[path_first_rows(walk, layout, logits.shape[0])],
            )
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )


def path_first_rows(walk: WalkResult, layout: StagedLayout, num_logits: int):
    """``[num_logits]`` logit rows with each request's rows reordered so that
    its accepted path (root first) leads, the rest following in node order."""
    perm = path_first_permutation(walk.path, layout.logit_rows.shape[1])
    valid = layout.num_nodes[:, None] > torch.arange(perm.shape[1], device=perm.device)
    src = layout.logit_rows.gather(1, perm)
    # Invalid (padding) entries scatter into one spare slot past the end.
    dst = torch.where(valid, layout.logit_rows, num_logits)
    order = torch.zeros(num_logits + 1, dtype=torch.long, device=perm.device)
    order.scatter_(0, dst.flatten(), src.flatten())
    return order[:num_logits]
