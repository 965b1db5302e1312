# SPDX-License-Identifier: Apache-2.0
"""DDTree proposer: vLLM's DFlash drafter, one forward, a best-first tree.

Subclasses :class:`~vllm.v1.spec_decode.dflash.DFlashProposer` so the DFlash
model, its context-KV precompute and every ``isinstance(drafter,
DFlashProposer)`` check in the runner keep working. Two things change:

* After a tree-verify step the target's hidden states of the accepted path
  are not at the head of each request's token range. The runner hands over
  a permutation (:meth:`set_accepted_order`) that moves them there; the
  rejected nodes become a chain-like rejected tail, so vLLM's padded DFlash
  input preparation (``num_rejected_tokens``) applies unchanged. Positions
  given to the drafter are the *linear* ones, which along the accepted path
  equal the depth positions used by the target.
* Instead of one argmax token per position, the drafter's log-probabilities
  at its ``max_depth`` positions feed :func:`build_trees`, and ``propose``
  returns the ``[num_reqs, K]`` first node tokens of every tree, ``K`` being
  the draft length vLLM asks for: the budget, or its batch-size schedule's
  value (``num_speculative_tokens_per_batch_size``). Nodes come best-first,
  so the first ``K`` nodes of a tree are a tree. Parents and depths stay on
  the proposer (:attr:`last_trees`) for the runner to pick up.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.v1.spec_decode.tree import DraftTrees, build_trees


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        cfg = get_ddtree_config(vllm_config)
        assert cfg is not None, "DDTreeProposer needs a DDTree config"
        self.ddtree = cfg
        if self.use_heterogeneous_vocab:
            raise ValueError(
                "method 'ddtree' needs a drafter that shares the target's "
                "vocabulary (use_heterogeneous_vocab is not supported)"
            )
        self._ensure_query_capacity(cfg.max_depth)
        self.last_trees: DraftTrees | None = None
        self._accepted_order: tuple[torch.Tensor, torch.Tensor] | None = None
        self._topk: tuple[torch.Tensor, torch.Tensor] | None = None

    def _ensure_query_capacity(self, max_depth: int) -> None:
        """Size DFlash's query buffers for what DDTree runs.

        DFlash sizes ``positions`` and the query slot mapping for
        ``max_num_seqs * (1 + num_speculative_tokens)`` queries. DDTree's
        ``num_speculative_tokens`` is the tree budget while the drafter runs
        ``max_depth`` queries per request, so that count can be too small
        (small budgets) and, with a budget off the CUDA-graph size grid, also
        smaller than the padded token count a captured drafter run slices
        (e.g. 4 x 65 = 260 queries padded to the 272-token graph: RoPE then
        sees fewer positions than tokens). The dispatcher pads nothing
        beyond the largest capture size, so buffers of at least that size
        cover every padded run.
        """
        self.max_query_tokens = max(
            self.max_query_tokens, self.max_batch_size * (1 + max_depth)
        )
        capture = self.vllm_config.compilation_config.max_cudagraph_capture_size
        capacity = max(self.max_query_tokens, capture or 0)
        if min(len(self.positions), len(self._slot_mapping_buffer)) >= capacity:
            return
        self.max_positions = self.max_num_tokens + capacity
        kwargs = dict(dtype=torch.int64, device=self.device)
        self._slot_mapping_buffer = torch.zeros(capacity, **kwargs)
        self.positions = torch.zeros(capacity, **kwargs)
        self.arange = torch.arange(
            self.max_positions + 1, dtype=torch.int32, device=self.device
        )

    @torch.inference_mode()
    def warm_up_input_kernel(self, block_table: torch.Tensor) -> None:
        """Compile every variant of DFlash's input preparation before serving
        (``block_table``: a one-request block table of the drafter's KV-cache
        group).

        vLLM's ``set_inputs_first_pass`` tiles a request's context and
        queries by the batch's longest query plus the drafter's queries,
        rounded up to a power of two (at most 256), as a compile-time
        constant, and has a second variant for padded batches (rejected
        counts given: every step after a verify). A tree's verify steps
        (``1 + B`` tokens a request) meet the small tiles only once a step is
        made of short prefills alone, mid-serving (the V2 speculator's
        warm-up says more). Triton also compiles a variant per class of the
        batch's token count (one, a multiple of 16, any other; H100,
        2026-12-07: an eager batch of 65-token trees met the 128 tile with
        a count off the multiples of 16, which no warm-up request had). A
        one-request batch of each power-of-two query length, and of the
        budget itself, reaches every tile, and its context (the batch's
        token count: the kernel reads only the request's own part) takes a
        length of each class from the query's length on, in both variants.
        """
        device = self.device
        # The drafter's query count, as ``propose`` sets it for a step.
        previous, self.num_speculative_tokens = (
            self.num_speculative_tokens,
            self.ddtree.max_depth,
        )
        next_token = torch.zeros(1, dtype=torch.int32, device=device)
        limit = self.max_num_tokens
        powers = {1 << i for i in range(limit.bit_length())}
        try:
            for query_len in sorted(powers | {limit}):
                multiple = -(-query_len // 16) * 16
                for num_context in sorted({query_len, multiple, multiple + 1}):
                    if num_context <= limit:
                        self._run_input_kernel(
                            query_len, num_context, next_token, block_table
                        )
        finally:
            self.num_speculative_tokens = previous

    def _run_input_kernel(
        self,
        query_len: int,
        num_context: int,
        next_token: torch.Tensor,
        block_table: torch.Tensor,
    ) -> None:
        """DFlash's input preparation for one request of ``query_len``
        context tokens in a context of ``num_context``, plain and padded."""
        device = self.device
        query_start = torch.tensor([0, query_len], dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=query_start.to(device),
            query_start_loc_cpu=query_start,
            seq_lens=query_start[1:].to(device),
            num_reqs=1,
            num_actual_tokens=query_len,
            max_query_len=query_len,
            max_seq_len=query_len,
            block_table_tensor=block_table,
            slot_mapping=torch.zeros(query_len, dtype=torch.int64, device=device),
        )
        context = torch.zeros(num_context, dtype=torch.int64, device=device)
        for rejected in (None, torch.zeros_like(next_token)):
            self.set_inputs_first_pass(
                target_token_ids=context,
                next_token_ids=next_token,
                target_positions=context,
                target_hidden_states=context,
                token_indices_to_sample=None,
                cad=cad,
                num_rejected_tokens_gpu=rejected,
            )

    def set_accepted_order(
        self,
        token_order: torch.Tensor | None,
        linear_positions: torch.Tensor | None = None,
    ) -> None:
        """Reorder the next ``propose``'s target tokens (accepted path first).

        ``token_order[i]`` is the batch token whose id and hidden state go to
        slot ``i``; ``linear_positions`` are the positions of the slots
        (``[3, tokens]`` for M-RoPE targets).
        ``None`` means the last step verified no tree: keep vLLM's order.
        """
        if token_order is None:
            self._accepted_order = None
        else:
            assert linear_positions is not None
            self._accepted_order = (token_order, linear_positions)

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids,
        target_positions,
        target_hidden_states,
        next_token_ids,
        token_indices_to_sample,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu=None,
        slot_mappings=None,
    ) -> torch.Tensor:
        if self._accepted_order is not None:
            order, linear_positions = self._accepted_order
            self._accepted_order = None
            num_tokens = target_token_ids.shape[0]
            order = order[:num_tokens]
            target_token_ids = target_token_ids[order]
            target_hidden_states = target_hidden_states[order]
            target_positions = linear_positions[..., :num_tokens]
        self.last_trees = None
        super().propose(
            self.ddtree.max_depth,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            common_attn_metadata,
            sampling_metadata,
            mm_embed_inputs,
            num_rejected_tokens_gpu,
            slot_mappings,
        )
        assert self._topk is not None
        values, tokens = self._topk
        self._topk = None
        self.last_trees = self._build_trees(values, tokens)
        return self.last_trees.tokens[:, :num_speculative_tokens].to(torch.int32)

    def _build_trees(self, values: torch.Tensor, tokens: torch.Tensor) -> DraftTrees:
        # A method of its own so that the step profiler can time it.
        return build_draft_trees(values, tokens, self.ddtree)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """Keep the top-``budget`` log-probabilities of every position."""
        values, tokens = draft_topk(
            self.model.compute_logits(hidden_states), self.ddtree.budget
        )
        self._topk = (values, tokens)
        return tokens[:, 0], None


def draft_topk(logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``budget`` log-probabilities (and tokens) of every drafted
    position. The tree uses the drafter's distribution at temperature 1
    whatever the request's sampling temperature (verification is lossless,
    so the drafter only has to rank well)."""
    k = min(budget, logits.shape[-1])
    if logits.is_cuda and logits.stride(-1) == 1:
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_draft_scores import draft_topk_triton

        return draft_topk_triton(logits, k)
    return logits.float().log_softmax(dim=-1).topk(k, dim=-1)


def build_draft_trees(
    values: torch.Tensor, tokens: torch.Tensor, cfg: DDTreeConfig
) -> DraftTrees:
    """The best-first trees of :func:`draft_topk`'s rows (``max_depth``
    consecutive rows per request): one Triton launch on a GPU (the torch
    build costs a launch per operation and depth), the torch build otherwise
    or when the budget is too large for the kernel's register sorts. Used by
    the V1 proposer and the V2 speculator."""
    k = values.shape[-1]
    values = values.view(-1, cfg.max_depth, k)
    tokens = tokens.view(-1, cfg.max_depth, k)
    if values.is_cuda:
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_tree_cores import build_trees_triton

        trees = build_trees_triton(values, tokens, cfg.budget, cfg.force_spine)
        if trees is not None:
            return trees
    return build_trees(values, tokens, cfg.budget, cfg.force_spine)
