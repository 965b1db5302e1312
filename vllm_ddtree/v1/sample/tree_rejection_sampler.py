# SPDX-License-Identifier: Apache-2.0
"""Tree verification: the target's choice at every node, then a tree walk.

Replaces vLLM's chain :class:`RejectionSampler` in the DDTree runner. Each
request row of the verify batch carries ``n`` drafted nodes plus the root, and
vLLM already computes target logits at all ``n + 1`` of them (in node order).
The target's token at every node is its argmax (greedy) or a sample from the
request's processed distribution (temperature / top-k / top-p);
:func:`walk_trees` then follows those choices. The sample is a Gumbel-max
draw keyed by the request's seed and the node's position, as vLLM's V2
runner draws it (:mod:`keyed_gumbel`): nodes at one depth share their noise,
nodes at different depths do not, and a seeded request gets the same tokens
whatever its trees (on a GPU, token for token the samples vLLM's V2 runner
draws without speculation). No draft
probabilities are involved: every emitted token is a target sample given its
exact prefix, so the output distribution is the target's (no Leviathan-style
``min(1, p/q)`` test, which is biased for top-k trees).

The output keeps vLLM's format: ``[num_reqs, max_spec_len + 1]`` int32, the
accepted drafted tokens then the bonus token, ``-1`` after. Everything
downstream (``parse_output``, the scheduler's accounting and stats, DFlash's
next-token preparation) works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_ddtree.v1.sample.keyed_gumbel import (
    keyed_gumbel_sample,
    scale_by_temperature,
)
from vllm_ddtree.v1.spec_decode.tree import WalkResult, walk_trees

# The dtype of V1's sampler-output rows, which the walk writes.
SAMPLED_TOKEN_DTYPE = torch.int32


@dataclass
class VerifyRows:
    """Where each node of each request sits in vLLM's flattened verify batch
    (request ``r`` has ``num_draft[r]`` drafts; its root and nodes are
    consecutive logit rows, its drafts consecutive draft-token rows).

    ``[R, W]`` maps over node ``j`` of request ``r`` (``W`` the widest tree):
    ``logit_rows`` and ``draft_rows`` (0 where invalid), ``is_draft`` (a
    valid non-root node); ``node_req`` gives every logit row's request.
    """

    num_nodes: torch.Tensor
    logit_rows: torch.Tensor
    draft_rows: torch.Tensor
    is_draft: torch.Tensor
    node_req: torch.Tensor

    @staticmethod
    def host_arrays(num_draft: np.ndarray) -> tuple[np.ndarray, ...]:
        """The maps on the host, in field order."""
        num_nodes = num_draft + 1
        node_ids = np.arange(int(num_nodes.max()))
        is_draft = (node_ids < num_nodes[:, None]) & (node_ids > 0)
        draft_starts = np.cumsum(num_draft) - num_draft
        draft_rows = np.where(is_draft, draft_starts[:, None] + node_ids - 1, 0)
        node_req = np.repeat(np.arange(len(num_nodes)), num_nodes)
        logit_rows = VerifyRows.logit_rows_of(num_nodes)
        return num_nodes, logit_rows, draft_rows, is_draft, node_req

    @staticmethod
    def logit_rows_of(num_nodes: np.ndarray) -> np.ndarray:
        """``logit_rows`` on the host from each request's node count."""
        node_ids = np.arange(int(num_nodes.max()))
        starts = np.cumsum(num_nodes) - num_nodes
        return np.where(node_ids < num_nodes[:, None], starts[:, None] + node_ids, 0)

    @classmethod
    def from_device(cls, tensors: list[torch.Tensor]) -> VerifyRows:
        """From the device copies of :meth:`host_arrays` (any int dtype)."""
        num_nodes, logit_rows, draft_rows, is_draft, node_req = tensors
        return cls(num_nodes, logit_rows, draft_rows, is_draft.bool(), node_req)


@dataclass
class TreeVerifyInput:
    """Tree structure of every row of the current verify batch.

    ``parents`` is ``[num_reqs, N]`` on the device (root column and padding
    ``-1``), ``max_depth`` bounds every node's depth. ``positions`` holds the
    (depth-based) position of every logit row, which keys its sample;
    ``rows`` the batch layout, uploaded with the runner's other step inputs.
    """

    parents: torch.Tensor
    max_depth: int
    positions: torch.Tensor
    rows: VerifyRows | None = None


# vLLM marks greedy requests with a non-positive temperature.
_GREEDY_EPS = 1e-5


def _top_k_top_p_per_row(
    logits: torch.Tensor, node_req: torch.Tensor, sampling_metadata: SamplingMetadata
) -> torch.Tensor:
    """vLLM's top-k / top-p with each logit row's request's settings
    (``node_req[i]`` is the request of row ``i``)."""
    top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
    return apply_top_k_top_p(
        logits,
        None if top_k is None else top_k[node_req],
        None if top_p is None else top_p[node_req],
    )


def _request_temperatures(sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """Each request's float32 temperature, 0 for greedy requests."""
    temperature = sampling_metadata.temperature.float()
    return torch.where(temperature < _GREEDY_EPS, 0.0, temperature)


def _processed_logits(
    logits: torch.Tensor, node_req: torch.Tensor, sampling_metadata: SamplingMetadata
) -> torch.Tensor:
    """Float logit rows after their request's temperature (greedy rows keep
    theirs) and top-k / top-p: the distribution a row's token is drawn from."""
    scaled = scale_by_temperature(
        logits, node_req, _request_temperatures(sampling_metadata)
    )
    return _top_k_top_p_per_row(scaled, node_req, sampling_metadata)


def request_seeds(
    generators: dict[int, torch.Generator], num_reqs: int, device: torch.device
) -> torch.Tensor:
    """Every request's Gumbel seed as vLLM's V2 sampler keys it: the seed of
    a seeded request (its generator's), a fresh random one otherwise."""
    seeds = torch.randint(
        -(2**63), 2**63 - 1, (num_reqs,), dtype=torch.int64, device=device
    )
    if generators:
        rows = list(generators)
        chosen = [g.initial_seed() for g in generators.values()]
        # A seed is a uint64 to torch and an int64 to vLLM's V2 sampler.
        chosen = [c - 2**64 if c >= 2**63 else c for c in chosen]
        # Built on the host and sent in one copy from pinned memory: this
        # runs after the forward pass is queued, and an upload from pageable
        # memory would wait for it.
        host = torch.tensor(
            [rows, chosen], dtype=torch.int64, pin_memory=device.type == "cuda"
        )
        rows_t, chosen_t = host.to(device, non_blocking=True)
        seeds[rows_t] = chosen_t
    return seeds


class PositionSeededTopKTopP(torch.nn.Module):
    """Wraps vLLM's V1 ``TopKTopPSampler`` (the last stage of its ``Sampler``)
    so that steps without drafts (prefills, steps whose drafter was skipped)
    draw the same Gumbel-max sample as the tree verification: keyed by
    (request seed, position). Without it a seeded request's first token came
    from the V1 generator and its later tokens from the keying, so its
    output would depend on where the drafter was skipped.

    The runner publishes ``positions`` (one per logit row, rows are requests)
    before every step that samples through vLLM's ``Sampler``; it is used once.
    Unpublished (dummy runs), the wrapped sampler runs unchanged.
    """

    def __init__(self, inner: torch.nn.Module, use_fp64_gumbel: bool) -> None:
        super().__init__()
        self.inner = inner
        self.use_fp64_gumbel = use_fp64_gumbel
        self.positions: torch.Tensor | None = None

    def forward(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions, self.positions = self.positions, None
        if positions is None:
            return self.inner(logits, generators, k, p)
        # ``logits`` already carry the temperature (vLLM's Sampler applied
        # it); greedy rows are replaced by their argmax after this call.
        logits = apply_top_k_top_p(logits, k, p)
        mode = self.inner.logprobs_mode
        processed = None
        if mode == "processed_logits":
            processed = logits
        elif mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        num_rows = logits.shape[0]
        rows = torch.arange(num_rows, device=logits.device)
        sampled = keyed_gumbel_sample(
            logits,
            rows,
            torch.ones(num_rows, dtype=torch.float32, device=logits.device),
            request_seeds(generators, num_rows, logits.device),
            positions,
            self.use_fp64_gumbel,
        )
        return sampled, processed


class TreeRejectionSampler(RejectionSampler):
    def __init__(
        self, sampler, spec_config=None, device=None, use_fp64_gumbel: bool = False
    ) -> None:
        super().__init__(sampler, spec_config, device)
        self.step: TreeVerifyInput | None = None
        self.last_walk: WalkResult | None = None
        self.use_fp64_gumbel = use_fp64_gumbel

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        step, self.step = self.step, None
        device = logits.device
        num_draft = np.asarray(metadata.num_draft_tokens, dtype=np.int64)
        if step is None:
            # No tree published (vLLM's dummy sampler run): verify chains,
            # all rows keyed at position 0.
            width = int(num_draft.max()) + 1
            chain = torch.arange(-1, width - 1, device=device)
            step = TreeVerifyInput(
                chain.expand(len(num_draft), width),
                width - 1,
                torch.zeros(logits.shape[0], dtype=torch.int64, device=device),
            )
        rows = step.rows
        if rows is None:
            arrays = VerifyRows.host_arrays(num_draft)
            rows = VerifyRows.from_device(
                [torch.from_numpy(a).to(device, non_blocking=True) for a in arrays]
            )
        choices = self._target_choices(logits, rows, step.positions, sampling_metadata)
        out = torch.full(
            (len(num_draft), metadata.max_spec_len + 1),
            PLACEHOLDER_TOKEN_ID,
            dtype=SAMPLED_TOKEN_DTYPE,
            device=device,
        )
        parents = step.parents[:, : rows.logit_rows.shape[1]]
        if logits.is_cuda:
            # One launch for the walk and the output rows. Imported here:
            # only GPU processes need Triton.
            from vllm_ddtree.v1.ops.triton_tree_cores import walk_trees_triton

            walk = walk_trees_triton(
                metadata.draft_token_ids,
                parents,
                rows.num_nodes,
                choices,
                step.max_depth,
                out,
                token_rows=rows.draft_rows,
                target_rows=rows.logit_rows,
            )
        else:
            node_tokens = torch.where(
                rows.is_draft, metadata.draft_token_ids[rows.draft_rows].long(), -1
            )
            target_tokens = choices[rows.logit_rows]
            walk = walk_trees(
                node_tokens, parents, rows.num_nodes, target_tokens, step.max_depth
            )
            path_nodes = walk.path[:, 1:]
            accepted = torch.gather(node_tokens, 1, path_nodes.clamp(min=0))
            out[:, : path_nodes.shape[1]] = torch.where(
                path_nodes >= 0, accepted, PLACEHOLDER_TOKEN_ID
            )
            out.scatter_(
                1, walk.num_accepted[:, None], walk.bonus[:, None].to(out.dtype)
            )
        self.last_walk = walk
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._output_logprobs(logits, rows, walk, out, sampling_metadata)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    def _output_logprobs(
        self,
        logits: torch.Tensor,
        rows: VerifyRows,
        walk: WalkResult,
        out: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> LogprobsTensors:
        """Logprobs of the output tokens in vLLM's layout (a row per output
        column of every request, rejected columns included; vLLM drops them
        with the tokens). Output column ``j`` was chosen at the accepted
        path's ``j``-th node, so its distribution is that node's logits, in
        the engine's ``logprobs_mode``."""
        num_reqs, num_cols = out.shape
        # One path entry per output column; rejected columns read the root's
        # row (their tokens are dropped).
        path = torch.nn.functional.pad(walk.path, (0, num_cols - walk.path.shape[1]))
        nodes = path.clamp(0, rows.logit_rows.shape[1] - 1).long()
        selected = logits[rows.logit_rows.gather(1, nodes).flatten()].float()
        if self.is_processed_logprobs_mode and not sampling_metadata.all_greedy:
            # (All-greedy batches have no temperature; vLLM leaves their
            # logits unprocessed too.)
            col_req = torch.arange(num_reqs, device=out.device).repeat_interleave(
                num_cols
            )
            selected = _processed_logits(selected, col_req, sampling_metadata)
        if not self.is_logits_logprobs_mode:
            selected = self.sampler.compute_logprobs(selected)
        tokens = out.flatten().long().clamp(min=0)
        return self.sampler.gather_logprobs(
            selected, sampling_metadata.max_num_logprobs, tokens
        )

    def _target_choices(
        self,
        logits: torch.Tensor,
        rows: VerifyRows,
        positions: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """The target's token at every logit row, drawn as vLLM's V2 runner
        draws its samples: temperature, top-k / top-p, then the argmax of the
        logits plus Gumbel noise seeded by ``(request seed, position)``
        (greedy rows get no noise). Requests without a seed get a fresh random
        one every step."""
        if sampling_metadata.all_greedy:
            return logits.argmax(dim=-1)
        num_reqs = sampling_metadata.temperature.shape[0]
        return keyed_gumbel_sample(
            _processed_logits(logits, rows.node_req, sampling_metadata),
            rows.node_req,
            _request_temperatures(sampling_metadata),
            request_seeds(sampling_metadata.generators, num_reqs, logits.device),
            positions,
            self.use_fp64_gumbel,
        )
