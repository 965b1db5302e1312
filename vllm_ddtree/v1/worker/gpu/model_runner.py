# SPDX-License-Identifier: Apache-2.0
"""DDTree on vLLM's V2 model runner (``ddtree.model_runner: "v2"``; dense
targets, fixed budgets).

V2 prepares a step's inputs on the device and never learns accepted counts
on the host: async scheduling is its design. DDTree fits in as follows (V1's
runner, ``v1/worker/ddtree_model_runner.py``, has the same step; the shared
parts are in ``v1/worker/verify_plan.py``):

1. ``__init__``: the DFlash speculator is built as :class:`DDTreeSpeculator`
   (V2 builds it by name); after the model loads, the chain rejection
   sampler is replaced by :class:`TreeWalkSampler`, and the model state's
   attention-metadata build publishes the step's trees to the tree backend.
2. The scheduler schedules each tree's ``B`` best-first nodes as the
   request's draft tokens; V2 writes them into the batch after the root.
3. ``prepare_attn``: V2 computes slot mappings from the linear positions;
   then every node's position becomes its root's position plus its depth,
   in V2's persistent position buffer (which full CUDA graphs read), and the
   trees' parents are gathered on the device by request-state slot. Short
   prompts scheduled beside the trees join the tree pass as chains (see
   ``stage_layout``), so such a step runs no FlashAttention pass.
4. Forward; :class:`TreeWalkSampler` draws the target's token at every node
   with V2's sampler and walks the trees; the walk's launch also puts the
   linear positions back and says where each node goes with its path first.
5. ``sample``: the accepted path's KV is copied into consecutive slots of
   every target attention layer (by the walk's launch where the layers
   form one group), and the speculator is told to read the accepted path's
   hidden states first.
6. V2 advances each request by its path and runs the speculator, which
   drafts ``max_depth`` positions and builds the next trees.

With ``ddtree.chain_from_batch_size`` a step whose drafts are all chains
(batches of that size propose them, see the speculator) is V2's own DFlash
step instead: linear positions, FlashAttention (the tree backend's stock
pass, no tree published) and V2's rejection sampler, without the tree
plan, walk and commit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import torch
from vllm.v1.worker.gpu import model_runner as v2_model_runner
from vllm.v1.worker.gpu.input_batch import InputBatch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.utils import AttentionGroup

from vllm_ddtree.config import DDTreeConfig, get_ddtree_config
from vllm_ddtree.v1.attention.backends.tree_attn import (
    UniformFill,
    publish_tree,
    uniform_tree_buffers,
)
from vllm_ddtree.v1.ops.triton_kv_commit import SlotRowsCommit
from vllm_ddtree.v1.worker.ddtree_model_runner import (
    DDTreeModelRunnerMixin,
    patched_attribute,
    warm_up_tree_kernels,
)
from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler import (
    SAMPLED_TOKEN_DTYPE,
    TreeWalkInput,
    TreeWalkSampler,
    WalkedTrees,
)
from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator import (
    DDTreeSpeculator,
)
from vllm_ddtree.v1.worker.verify_plan import (
    KVCommitPlan,
    LayoutStager,
    UniformTarget,
    VerifyPlan,
    compact_kv,
    kv_commit_plan,
    lay_out_trees,
    tree_attention_info,
)


class DDTreeV2ModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        with patched_attribute(v2_model_runner, "init_speculator", DDTreeSpeculator):
            super().__init__(vllm_config, device)
        cfg = get_ddtree_config(vllm_config)
        assert cfg is not None, "the DDTree runner needs method 'ddtree'"
        if cfg.chain_length is not None:
            check_chain_steps(vllm_config, cfg)
        self.ddtree = cfg
        # Short prompts beside the trees are chain rows of the tree pass
        # (FlashAttention then sits out that step), up to the largest tree
        # the tree kernels are compiled for at start-up. On a GPU the step's
        # Triton launches need no node maps (the torch forms, on a CPU, do).
        self.layouts = LayoutStager(
            device,
            chain_rows_upto=1 + cfg.budget,
            node_maps=torch.device(device).type != "cuda",
        )
        # The tree attention builders' graph buffers (shared, see
        # uniform_tree_buffers).
        self._uniform_trees = uniform_tree_buffers(vllm_config, device)
        self._plan: VerifyPlan | None = None
        self._kv_commits: KVCommitPlan | None = None

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if self.rejection_sampler is not None:
            self.rejection_sampler = TreeWalkSampler(
                self.sampler,
                self.speculative_config,
                self.device,
                self.ddtree.max_depth,
            )
        build = self.model_state.prepare_attn

        def prepare_attn(
            input_batch,
            cudagraph_mode,
            block_tables,
            slot_mappings,
            attn_groups,
            *build_args,
            **build_kwargs,
        ):
            # The target step's metadata, less the drafter-only groups (see
            # target_attn_groups); the speculator passes its own groups.
            if attn_groups is self.attn_groups:
                attn_groups = self._target_attn_groups
            # V2's builders only receive CommonAttentionMetadata; the tree
            # backends read the step's trees from this side channel.
            tree = self._plan.tree if self._plan is not None else None
            with publish_tree(tree):
                return build(
                    input_batch,
                    cudagraph_mode,
                    block_tables,
                    slot_mappings,
                    attn_groups,
                    *build_args,
                    **build_kwargs,
                )

        self.model_state.prepare_attn = prepare_attn

    def initialize_kv_cache(self, kv_cache_config) -> None:
        super().initialize_kv_cache(kv_cache_config)
        self._target_attn_groups = target_attn_groups(
            self.attn_groups, self.speculator.draft_attn_layer_names
        )

    # -- step 3: depth positions and tree layout ----------------------------

    def prepare_attn(self, input_batch: InputBatch):
        block_tables, slot_mappings = super().prepare_attn(input_batch)
        self._plan = None
        if input_batch.num_draft_tokens > 0 and not self._verifies_chains(input_batch):
            self._plan = self._plan_verify(input_batch)
        return block_tables, slot_mappings

    def _verifies_chains(self, input_batch: InputBatch) -> bool:
        """Whether the step is a chain step: every draft is a chain's length.

        Chain batches propose chains of that length and tree batches never
        trees of it (``config.with_chain_steps``). A request can still be
        cut to it by the token budget, and its nodes then pass as a chain:
        any draft verified in order keeps the target's output (the stock
        rejection sampler's), only acceptance suffers. The other way round
        (a chain cut shorter, beside trees) the tree step verifies the
        chain as the tree the speculator keeps for it."""
        chain = self.ddtree.chain_length
        if chain is None:
            return False
        drafts = input_batch.num_draft_tokens_per_req
        return bool(np.all((drafts == 0) | (drafts == chain)))

    def _plan_verify(self, input_batch: InputBatch) -> VerifyPlan:
        """Lay out this step's trees (each request's from its last proposal,
        gathered on the device by request-state slot), move the nodes to
        their depth positions and publish the walk's input."""
        num_reqs = input_batch.num_reqs
        num_nodes = input_batch.num_draft_tokens_per_req.astype(np.int64) + 1
        layout = self.layouts(
            num_nodes,
            input_batch.query_start_loc_np[1 : num_reqs + 1],
        )
        max_depth = min(self.ddtree.max_depth, layout.width - 1)
        uniform = self._uniform_target(input_batch, num_nodes, layout.width)
        parents, tree_rows = lay_out_trees(
            layout,
            self.speculator.req_tree_shapes,
            input_batch.idx_mapping,
            self.input_buffers.positions,
            input_batch.seq_lens,
            uniform,
        )
        self.rejection_sampler.step = TreeWalkInput(
            parents[:num_reqs],
            layout,
            max_depth,
            self.input_buffers.positions,
            self._walk_kv_commit,
        )
        seq_lens = input_batch.seq_lens_cpu_upper_bound[:num_reqs].numpy()
        tree = tree_attention_info(
            layout, tree_rows, seq_lens.astype(np.int64), max_depth
        )
        if tree is not None and uniform is not None:
            tree.uniform_fill = UniformFill(uniform.buffers, uniform.num_reqs, parents)
        return VerifyPlan(layout, None, tree)

    def _uniform_target(
        self, input_batch: InputBatch, num_nodes: np.ndarray, width: int
    ) -> UniformTarget | None:
        """The graph buffers the lay-out launch fills when every request is
        a tree of one size that has them (the batch vLLM replays as a full
        CUDA graph, padded to ``num_reqs_after_padding`` rows), so that the
        tree metadata builder's :meth:`~UniformTreeBuffers.fill` launches
        nothing."""
        buffers = self._uniform_trees.get(width)
        if (
            buffers is None
            or self.device.type != "cuda"
            or input_batch.num_reqs_after_padding > buffers.max_num_reqs
            or not bool(np.all(num_nodes == width))
        ):
            return None
        return UniformTarget(buffers, input_batch.num_reqs_after_padding)

    # -- step 5: commit the accepted path -----------------------------------

    def sample(self, hidden_states, input_batch, grammar_output):
        result = super().sample(hidden_states, input_batch, grammar_output)
        self._plan = None
        sampler = self.rejection_sampler
        walked, sampler.last_walk = sampler.last_walk, None
        if walked is not None:
            self._commit_path(walked)
        return result

    def _commit_path(self, walked: WalkedTrees) -> None:
        """Move the accepted paths' KV to consecutive slots, unless the
        walk's launch did, and hand the speculator the path-first order of
        the batch's (padded) tokens (written by the walk's launch, which
        also put the linear positions back). Runs before the speculator: it
        writes its own query slots into the same slot-mapping buffer the
        compaction reads."""
        if not walked.kv_committed:
            compact_kv(
                self._kv_commit_plan(),
                self._slot_mapping,
                walked.path_first.root,
                walked.walk.path,
            )
        self.speculator.set_accepted_order(walked.path_first.order)

    def _slot_mapping(self, gid: int) -> torch.Tensor:
        """The current step's slot of every batch token in KV-cache group
        ``gid`` (V2's persistent buffer)."""
        return self.block_tables.slot_mappings[gid]

    @functools.cached_property
    def _walk_kv_commit(self) -> tuple[SlotRowsCommit, torch.Tensor] | None:
        """The KV commit the walk's launch makes (a launch a step less):
        when the target's attention layers form one KV-cache group with a
        one-launch commit (FlashAttention's NHD caches on a GPU), that
        commit and the group's slot-mapping buffer; else ``None``, and
        :meth:`_commit_path` commits after the walk."""
        plan = self._kv_commit_plan()
        if len(plan) != 1:
            return None
        ((gid, (_, commit)),) = plan.items()
        return None if commit is None else (commit, self._slot_mapping(gid))

    def _kv_commit_plan(self) -> KVCommitPlan:
        if self._kv_commits is None:
            self._kv_commits = kv_commit_plan(
                self.kv_cache_config,
                self.compilation_config.static_forward_context,
                self.speculator.draft_attn_layer_names,
            )
        return self._kv_commits

    # -- start-up (called by the DDTree worker) ------------------------------

    def warm_up_tree_kernels(self) -> None:
        warm_up_tree_kernels(
            self,
            lambda gid: self.block_tables.input_block_tables[gid][:1],
            SAMPLED_TOKEN_DTYPE,
            v2_runner=True,
            walk_kv_commit=self._walk_kv_commit,
        )
        self.speculator.warm_up_input_kernel(
            self.req_states.last_sampled_tokens, self.req_states.next_prefill_tokens
        )

    # The same sizes decide whether V2 captures, and schedules, a full batch
    # of full trees.
    uncaptured_full_batch_hint = DDTreeModelRunnerMixin.uncaptured_full_batch_hint
    token_budget_hint = DDTreeModelRunnerMixin.token_budget_hint


def check_chain_steps(vllm_config, cfg: DDTreeConfig) -> None:
    """Chain steps need a batch that reaches their size, and vLLM's
    batch-size schedule (which asks chain batches for chains) to reach the
    scheduler's drafts: under async scheduling only, and vLLM drops the
    schedule under data parallelism."""
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    if cfg.chain_from_batch_size > max_num_seqs:
        raise ValueError(
            f"ddtree.chain_from_batch_size = {cfg.chain_from_batch_size} is more "
            f"than max_num_seqs = {max_num_seqs}: no batch would take chain "
            "steps. Lower it, or leave it out."
        )
    if not vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            "ddtree.chain_from_batch_size needs async scheduling (vLLM's V2 "
            "scheduler applies its batch-size schedule of draft lengths only "
            "when it schedules ahead): enable it, or leave "
            "chain_from_batch_size out."
        )
    if vllm_config.speculative_config.num_speculative_tokens_per_batch_size is None:
        raise ValueError(
            "ddtree.chain_from_batch_size needs vLLM's batch-size schedule of "
            "draft lengths, which vLLM turns off under data parallelism: "
            "leave chain_from_batch_size out there."
        )


def target_attn_groups(
    attn_groups: list[list[AttentionGroup]], draft_layers: Iterable[str]
) -> list[list[AttentionGroup]]:
    """The runner's attention groups less those made only of drafter layers.

    V2 builds the target step's attention metadata for every group of the
    KV-cache config, the drafter's layers included (the drafter builds its
    own when it runs). Stock DFlash's drafter layers share the target's
    backend and group, so that costs nothing; DDTree's target layers use the
    tree backend, and the drafter's FlashAttention layers form a group of
    their own whose metadata the target forward never reads: one builder
    call (~0.14 ms of host time on an H100) a step for nothing."""
    draft = set(draft_layers)
    return [
        [group for group in groups if not set(group.layer_names) <= draft]
        for groups in attn_groups
    ]
