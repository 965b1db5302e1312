# SPDX-License-Identifier: Apache-2.0
"""DDTree's drafter on vLLM's V2 model runner: DFlash drafting trees.

Subclasses V2's :class:`DFlashSpeculator` (its input preparation, context-KV
precompute and CUDA graphs stay vLLM's). Three things change:

* The drafter queries ``1 + max_depth`` positions per request, whatever the
  node budget ``B`` (V2 sizes DFlash's queries by ``num_speculative_tokens``,
  which for DDTree is ``B``), and its CUDA graphs are captured for that one
  query length also under a batch-size schedule of tree sizes.
* ``_generate_draft`` (the part V2 captures in a CUDA graph) keeps the
  top-``B`` log-probabilities of every drafted position and builds the
  best-first trees in one Triton launch, on the device, inside the graph.
  ``propose`` returns every tree's ``B`` node tokens, which the runner stores
  as the request's draft tokens, and keeps each request's parents and depths
  (indexed by its request-state slot, side by side so that one copy stores
  them) for the next verify step.
* After a tree-verify step the accepted path is not at the head of a
  request's token range: the runner hands over a permutation of the target
  tokens (:meth:`set_accepted_order`) that puts it there, so DFlash's
  ``num_rejected`` arithmetic reads the accepted path as a chain.

With chain steps (``ddtree.chain_from_batch_size``) the graph also keeps
DFlash's own chain, the argmax of every drafted position, and a batch of
at least that many requests proposes chains: the scheduler asks each of its
requests for a chain's draft length (see ``config.with_chain_steps``), the
same batch size deciding both. A request's chain is also kept as its tree
(each node the child of the one before), for a step that verifies it beside
trees.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.v1.spec_decode.ddtree_proposer import build_draft_trees, draft_topk
from vllm_ddtree.v1.spec_decode.tree import DraftTrees


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        super().__init__(vllm_config, device)
        cfg = get_ddtree_config(vllm_config)
        assert cfg is not None, "DDTreeSpeculator needs a DDTree config"
        self.ddtree = cfg
        depth, budget = cfg.max_depth, cfg.budget
        self.num_speculative_steps = depth
        self.num_query_per_req = 1 + depth
        num_samples = self.max_num_reqs * depth
        as_long = dict(dtype=torch.int64, device=device)
        self.sample_indices = torch.zeros(num_samples, **as_long)
        self.sample_pos = torch.zeros(num_samples, **as_long)
        self.sample_idx_mapping = torch.zeros(
            num_samples, dtype=torch.int32, device=device
        )
        self.sample_col = torch.arange(depth, dtype=torch.int32, device=device).repeat(
            self.max_num_reqs
        )
        self._init_tree_buffers(self.max_num_reqs, budget, device)
        self._accepted_order: torch.Tensor | None = None

    def _init_tree_buffers(
        self, num_rows: int, budget: int, device: torch.device
    ) -> None:
        # The last proposal's trees, by batch row (written inside the graph);
        # their parents and depths are views of ``tree_shapes [rows, 2, B]``.
        self.tree_shapes = torch.zeros(
            num_rows, 2, budget, dtype=torch.int64, device=device
        )
        self.trees = DraftTrees(
            tokens=torch.zeros(num_rows, budget, dtype=torch.int64, device=device),
            parents=self.tree_shapes[:, 0],
            depths=self.tree_shapes[:, 1],
            scores=torch.zeros(num_rows, budget, device=device),
        )
        # Each request's current tree's (parents, depths), by request-state
        # slot: what the next verify step of that request checks.
        self._req_tree_shapes = torch.zeros_like(self.tree_shapes)
        # With chain steps: the last proposal's chains, by batch row (written
        # inside the graph; ``budget`` columns like the trees' tokens, as V2
        # stores a request's draft), and a chain's (parents, depths) as a
        # tree, its columns past the chain a valid filler of root children.
        chain = self.ddtree.chain_length
        if chain is not None:
            self.chain_drafts = torch.zeros_like(self.trees.tokens)
            self._chain_shapes = torch.ones(2, budget, dtype=torch.int64, device=device)
            self._chain_shapes[0] = 0
            self._chain_shapes[0, :chain] = torch.arange(chain)
            self._chain_shapes[1, :chain] = torch.arange(1, chain + 1)

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        # Under ``num_speculative_tokens_per_batch_size`` vLLM's graph manager
        # captures one query length per scheduled draft length, shifted by
        # ``num_query_per_req - num_speculative_tokens``: for DFlash chains
        # each is a drafter query length; for trees (``B`` nodes, ``1 +
        # max_depth`` drafter rows) they are not, and can go negative (the
        # capture then fails). The manager reads the schedule only while it
        # builds its capture list, here.
        spec = self.vllm_config.speculative_config
        schedule = spec.num_speculative_tokens_per_batch_size
        spec.num_speculative_tokens_per_batch_size = None
        try:
            super().init_cudagraph_manager(cudagraph_mode)
        finally:
            spec.num_speculative_tokens_per_batch_size = schedule

    def warm_up_input_kernel(
        self, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor
    ) -> None:
        """Compile every tile of DFlash's input preparation before serving
        (``last_sampled`` / ``next_prefill_tokens``: the runner's request
        states, as it passes them to :meth:`propose`).

        vLLM's ``prepare_dflash_inputs`` tiles a request's context and
        queries by the batch's longest query plus the drafter's queries,
        rounded up to a power of two: a compile-time constant, so a tile
        first needed mid-serving compiles then (150 ms on an H100: the first
        step of a profiled batch-16 run). vLLM's warm-up meets the tiles of
        its dummy batches and a chain's decode steps, with short queries,
        meet DFlash's small tile early on. A DDTree step verifies ``1 + B``
        tokens a request: until a step is made only of short prefills (a
        prompt whose prefix is cached), the small tile never runs, and such
        a step came first in every timed benchmark run after a warm-up on
        the same prompts. Here one request with each power-of-two query
        length up to the batch's token budget reaches them all.
        """
        device = self.input_buffers.positions.device
        # One request, its last step sampled one token and rejected none.
        num_sampled = torch.ones(1, dtype=torch.int32, device=device)
        num_rejected = torch.zeros(1, dtype=torch.int32, device=device)
        query_len = 1
        while query_len <= self.max_num_tokens:
            batch = SimpleNamespace(
                num_reqs=1,
                num_scheduled_tokens=np.array([query_len]),
                positions=torch.zeros(query_len, dtype=torch.int64, device=device),
                query_start_loc=torch.tensor(
                    [0, query_len], dtype=torch.int32, device=device
                ),
                idx_mapping=torch.zeros_like(num_rejected),
            )
            for i, gid in enumerate(self.draft_kv_cache_group_ids):
                dflash_speculator.prepare_dflash_inputs(
                    self.input_buffers,
                    self.block_tables.slot_mappings[gid],
                    self.context_positions,
                    self._context_slot_mappings[i],
                    self.sample_indices,
                    self.sample_pos,
                    self.sample_idx_mapping,
                    batch,
                    num_sampled,
                    num_rejected,
                    last_sampled,
                    next_prefill_tokens,
                    self.block_tables.input_block_tables[gid],
                    self.block_tables.kernel_block_sizes[gid],
                    self.parallel_drafting_token_id,
                    self.num_query_per_req,
                    self.num_speculative_steps,
                    self.max_num_reqs,
                    self.max_num_tokens,
                    self.max_model_len,
                    self.sample_from_anchor,
                )
            query_len *= 2

    @property
    def req_tree_shapes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(parents, depths)`` ``[slots, B]`` of each request's current
        tree, by request-state slot."""
        return self._req_tree_shapes[:, 0], self._req_tree_shapes[:, 1]

    def set_accepted_order(self, token_order: torch.Tensor | None) -> None:
        """``token_order[i]`` is the target token whose hidden states go to
        slot ``i`` in the next :meth:`propose` (for at least the batch's
        tokens); ``None``: keep vLLM's order."""
        self._accepted_order = token_order

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata,
        slot_mappings,
        num_tokens_across_dp,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        hidden_states = self._run_model(
            num_tokens_padded,
            attn_metadata,
            slot_mappings,
            num_tokens_across_dp,
            cudagraph_runtime_mode,
        )
        rows = self.sample_indices[: num_reqs * self.num_speculative_steps]
        logits = self.model.compute_logits(hidden_states[rows])
        values, tokens = draft_topk(logits, self.ddtree.budget)
        trees = build_draft_trees(values, tokens, self.ddtree)
        for name in _TREE_FIELDS:
            getattr(self.trees, name)[:num_reqs] = getattr(trees, name)
        chain = self.ddtree.chain_length
        if chain is not None:
            # DFlash's greedy draft, ties to the first token as DFlash breaks
            # them (a top-k leaves the order of tied logits open, and bf16
            # logits do tie).
            top = logits.argmax(dim=-1).view(num_reqs, self.num_speculative_steps)
            self.chain_drafts[:num_reqs, :chain] = top[:, :chain]

    @torch.inference_mode()
    def propose(
        self,
        input_batch,
        attn_metadata,
        slot_mappings,
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        order, self._accepted_order = self._accepted_order, None
        if order is not None:
            if aux_hidden_states:
                # DFlash reads its target layers' states alone when it has
                # them: it projects their concatenation per token
                # (``combine_hidden_states``, first thing in vLLM 0.26.0's
                # ``DFlashSpeculator.propose``) and reads the last hidden
                # states only without them. The projection is made here and
                # handed over path-first as those states: one gather of 1/L
                # of the concatenation's width (L target layers), and no
                # second copy of the concatenation. A wrong order here costs
                # acceptance, never correctness.
                combined = self.model.combine_hidden_states(
                    torch.cat(aux_hidden_states, dim=-1)
                )
                last_hidden_states = _permute_head(combined, order)
                aux_hidden_states = None
            else:
                last_hidden_states = _permute_head(last_hidden_states, order)
        super().propose(
            input_batch,
            attn_metadata,
            slot_mappings,
            last_hidden_states,
            aux_hidden_states,
            *args,
            **kwargs,
        )
        num_reqs = input_batch.num_reqs
        if self._proposes_chains(num_reqs):
            self._req_tree_shapes[input_batch.idx_mapping] = self._chain_shapes
            return self.chain_drafts[:num_reqs]
        self._req_tree_shapes[input_batch.idx_mapping] = self.tree_shapes[:num_reqs]
        return self.trees.tokens[:num_reqs]

    def _proposes_chains(self, num_reqs: int) -> bool:
        """Whether a batch of ``num_reqs`` requests proposes chains (the
        scheduler asks such a batch for ``chain_length`` draft tokens)."""
        start = self.ddtree.chain_from_batch_size
        return start is not None and num_reqs >= start


_TREE_FIELDS = ("tokens", "parents", "depths", "scores")


def _permute_head(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``rows`` with its first ``len(order)`` rows permuted by ``order`` (the
    rest, CUDA-graph padding, unchanged). An order at least as long as
    ``rows`` (one over the padded batch, which only moves real tokens) is a
    single gather."""
    n = order.shape[0]
    if n >= rows.shape[0]:
        return rows.index_select(0, order[: rows.shape[0]])
    return torch.cat([rows[:n][order], rows[n:]])
