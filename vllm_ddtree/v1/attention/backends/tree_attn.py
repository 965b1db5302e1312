# SPDX-License-Identifier: Apache-2.0
"""Backend-independent pieces of tree attention.

* :class:`TreeAttentionInfo` describes the tree-verify requests of one batch.
  The DDTree model runner builds it once per step and *publishes* it while
  vLLM builds the target's attention metadata (:func:`publish_tree`); the
  tree backends' metadata builders pick it up with :func:`current_tree`.
  vLLM's V1 builders only receive a ``CommonAttentionMetadata``, so this
  per-process side channel is the least invasive way in.
* :class:`UniformTreeBuffers` holds the tree inputs at fixed device
  addresses for batches of equal trees, the shape vLLM replays as one full
  CUDA graph; :func:`uniform_tree_buffers` makes one per tree size such a
  graph can have.
* :class:`PagedKVLayout` knows where the key and value of a (block, offset)
  live inside one layer's KV-cache tensor, so tree attention can gather the
  context and the runner can move accepted-path KV between slots, for any
  backend layout (the CPU kernels pack K/V in ISA-specific orders).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.attention.backend import AttentionType

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.v1.spec_decode.tree import ancestor_mask


@dataclass
class TreeAttentionInfo:
    """The tree-verify requests of one batch (``R`` of them).

    Tensors live on the model's device; ``*_cpu`` twins are host lists for
    the CPU path, which loops over requests. ``ctx_len_cpu`` may exceed
    ``ctx_len`` (under async scheduling the host assumes the last step
    accepted every draft): it only bounds the context lengths.

    Attributes:
        req_rows: ``[R]`` batch row (request index) of each tree request.
        q_start: ``[R]`` index of the request's root token in the batch.
        num_nodes: ``[R]`` query tokens of the tree, root included.
        ctx_len: ``[R]`` tokens before the root; the tree occupies cache
            positions ``ctx_len .. ctx_len + num_nodes - 1``.
        parents: ``[R, N]`` parent node index of each node (``-1`` for the
            root and padding), topological order.
        max_depth: bound on every node's depth.
        covers_batch: every token of the batch is a tree node, so the
            backend's stock kernel has nothing left to do.
        ctx_len_bound: set for batches built without a host copy of the
            context lengths (:class:`UniformTreeBuffers`): the bound that
            stands in for ``max(ctx_len_cpu)``, whose entries are then this
            bound too.
        packed: the packed ancestor masks and their first rows, when they
            are packed already (a uniform batch's graph buffers, or the
            runner's lay-out launch; see :attr:`packed_mask`).
        uniform_fill: set when the runner already wrote this step's inputs
            into the graph buffers of a uniform batch (see
            :class:`UniformFill`).
    """

    req_rows: torch.Tensor
    q_start: torch.Tensor
    num_nodes: torch.Tensor
    ctx_len: torch.Tensor
    parents: torch.Tensor
    max_depth: int
    req_rows_cpu: list[int]
    q_start_cpu: list[int]
    num_nodes_cpu: list[int]
    ctx_len_cpu: list[int]
    covers_batch: bool = False
    ctx_len_bound: int | None = None
    packed: tuple[torch.Tensor, torch.Tensor] | None = None
    uniform_fill: UniformFill | None = None

    @functools.cached_property
    def max_nodes(self) -> int:
        return max(self.num_nodes_cpu)

    @functools.cached_property
    def max_ctx_len(self) -> int:
        if self.ctx_len_bound is not None:
            return self.ctx_len_bound
        return max(self.ctx_len_cpu)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """``[R, N, N]`` bool ancestor-or-self matrix of each tree (the torch
        path's form). Built on first use, once per step."""
        return ancestor_mask(self.parents, self.num_nodes, self.max_depth)

    @functools.cached_property
    def packed_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ancestor masks bit-packed for the Triton kernel, with each
        request's first mask row (see :func:`pack_ancestor_mask`). Built on
        first use, once per step."""
        if self.packed is not None:
            return self.packed
        # The running sum on the device: the host's, uploaded from pageable
        # memory, would make the host wait for the GPU's queued work (see
        # ``v1/worker/host_staging.py``) in every batch that is not uniform
        # (prefills beside the trees), in the first layer's forward.
        starts = torch.cumsum(self.num_nodes, 0, dtype=torch.int32)
        starts -= self.num_nodes
        return self.pack_mask(starts), starts

    def pack_mask(
        self, row_start: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Bit-pack the ancestor masks, request ``r``'s from row
        ``row_start[r]`` (which must be the running sum of the node counts),
        into ``out`` when given. On a GPU in one launch from ``parents``."""
        if not self.parents.is_cuda:
            packed, _ = pack_ancestor_mask(self.mask, self.num_nodes_cpu)
            return packed if out is None else out.copy_(packed)
        # Imported here: only GPU processes need Triton.
        from vllm_ddtree.v1.ops.triton_tree_cores import packed_ancestor_mask_triton

        return packed_ancestor_mask_triton(
            self.parents,
            self.num_nodes,
            row_start,
            sum(self.num_nodes_cpu),
            self.max_depth,
            out=out,
        )


_current_tree: TreeAttentionInfo | None = None


@contextmanager
def publish_tree(info: TreeAttentionInfo | None) -> Iterator[None]:
    """Make ``info`` visible to tree metadata builders inside the block."""
    global _current_tree
    previous, _current_tree = _current_tree, info
    try:
        yield
    finally:
        _current_tree = previous


def current_tree() -> TreeAttentionInfo | None:
    """The tree published for the metadata being built, if any."""
    return _current_tree


class UniformTreeBuffers:
    """Tree-attention inputs at fixed device addresses for *uniform* batches:
    every request runs a query of exactly ``num_nodes`` tokens
    (``1 + num_speculative_tokens``), which is the batch shape vLLM captures
    and replays as one full CUDA graph.

    A replayed graph runs no Python: the attention kernel reads whatever the
    captured addresses hold. So :meth:`fill` (called by the metadata builder,
    outside the graph, every step) writes this step's context lengths and
    ancestor masks into the same buffers the capture used, and the kernel
    launch depends on nothing else that changes between steps (the rows'
    query offsets are ``r * num_nodes``; the split-KV factor follows from
    ``ctx_len_bound``, not from this step's contexts).

    A uniform batch without a published tree (e.g. equal prefill chunks of
    ``num_nodes`` tokens, or the capture itself) is a batch of chains: the
    chain mask is causal attention. So are the rows of such prompts or
    chunks beside trees. Rows of graph padding (requests with no
    query tokens) keep a valid mask and a non-negative context, so their
    discarded outputs stay finite.
    """

    def __init__(
        self,
        max_num_reqs: int,
        num_nodes: int,
        ctx_len_bound: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.num_nodes = num_nodes
        self.ctx_len_bound = ctx_len_bound
        rows = torch.arange(max_num_reqs, dtype=torch.int32, device=device)
        self.req_rows = rows
        self.q_start = rows * num_nodes
        self.node_counts = torch.full_like(rows, num_nodes)
        self.ctx_len = torch.zeros_like(rows)
        chain = torch.arange(num_nodes, device=device) - 1
        self.chain_parents = chain.expand(max_num_reqs, num_nodes).contiguous()
        causal = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device)
        one_chain, _ = pack_ancestor_mask(causal.tril()[None], [num_nodes])
        self.chain_mask = one_chain.repeat(max_num_reqs, 1)
        self.mask = self.chain_mask.clone()

    def matches(self, query_start_loc_cpu: torch.Tensor) -> bool:
        """Whether a batch (its host query offsets) is uniform: every query
        is ``num_nodes`` tokens long, bar empty padding requests."""
        lens = np.diff(query_start_loc_cpu.numpy())
        return (
            0 < len(lens) <= self.max_num_reqs
            and int(lens.max()) == self.num_nodes
            and bool(np.all((lens == self.num_nodes) | (lens == 0)))
        )

    def fill(
        self,
        num_reqs: int,
        seq_lens: torch.Tensor,
        tree: TreeAttentionInfo | None,
    ) -> TreeAttentionInfo:
        """Write a uniform batch's inputs into the buffers and describe it
        (only describe it when the runner's lay-out launch already wrote
        them: ``tree.uniform_fill``).

        ``seq_lens`` (``[num_reqs]``, device) counts each request's context
        plus its query; ``tree`` is the step's published tree, whose trees
        have ``num_nodes`` nodes each (at any rows; the batch's other rows
        are chains).
        """
        done = tree.uniform_fill if tree is not None else None
        if done is not None and done.buffers is self and done.num_reqs == num_reqs:
            return self._describe(num_reqs, done.parents, self.num_nodes - 1)
        n = self.num_nodes
        ctx = self.ctx_len[:num_reqs]
        torch.sub(seq_lens[:num_reqs], n, out=ctx)
        ctx.clamp_(min=0)
        if tree is not None and set(tree.num_nodes_cpu) != {n}:
            raise ValueError(
                f"a uniform batch's published trees must have {n} nodes each, "
                f"got {sorted(set(tree.num_nodes_cpu))}"
            )
        num_trees = 0 if tree is None else len(tree.num_nodes_cpu)
        if (
            tree is not None
            and tree.covers_batch
            and tree.req_rows_cpu == list(range(num_trees))
        ):
            # Steady-state decoding: the trees are the batch's first requests,
            # in order (graph padding after them), so request r's masks are
            # rows r * n onwards in its packing as in the buffer.
            tree.pack_mask(self.q_start[:num_trees], out=self.mask[: num_trees * n])
            parents, max_depth = tree.parents, tree.max_depth
        else:
            # Chains (causal attention), with any trees written over their
            # own rows: the other n-token queries are prompts or prefill
            # chunks that happen to be n tokens long.
            self.mask[: num_reqs * n].copy_(self.chain_mask[: num_reqs * n])
            parents, max_depth = self.chain_parents[:num_reqs], n - 1
            if tree is not None:
                rows = tree.req_rows.long()
                packed = tree.pack_mask(self.q_start[:num_trees])
                self.mask[: num_reqs * n].view(num_reqs, n, -1)[rows] = packed.view(
                    num_trees, n, -1
                )
                parents = parents.clone()
                parents[rows] = tree.parents[:, :n].to(parents.dtype)
        return self._describe(num_reqs, parents, max_depth)

    def _describe(
        self, num_reqs: int, parents: torch.Tensor, max_depth: int
    ) -> TreeAttentionInfo:
        """The batch of the first ``num_reqs`` rows, as the buffers hold it."""
        n = self.num_nodes
        return TreeAttentionInfo(
            req_rows=self.req_rows[:num_reqs],
            q_start=self.q_start[:num_reqs],
            num_nodes=self.node_counts[:num_reqs],
            ctx_len=self.ctx_len[:num_reqs],
            parents=parents,
            max_depth=max_depth,
            req_rows_cpu=list(range(num_reqs)),
            q_start_cpu=list(range(0, num_reqs * n, n)),
            num_nodes_cpu=[n] * num_reqs,
            ctx_len_cpu=[self.ctx_len_bound] * num_reqs,
            covers_batch=True,
            ctx_len_bound=self.ctx_len_bound,
            packed=(self.mask[: num_reqs * n], self.q_start[:num_reqs]),
        )


@dataclass
class UniformFill:
    """This step's inputs of a uniform batch, already in ``buffers`` (the
    V2 runner's tree lay-out launch writes them, which saves :meth:`fill`
    its launches): context lengths and ancestor masks of the first
    ``num_reqs`` rows (graph padding included, as chains), whose
    ``parents`` are ``[num_reqs, n]``. A builder that sees another row
    count (a batch it does not pad) fills the buffers itself."""

    buffers: UniformTreeBuffers
    num_reqs: int
    parents: torch.Tensor


def uniform_tree_buffers(
    vllm_config, device: torch.device
) -> dict[int, UniformTreeBuffers]:
    """Graph buffers for every query length of a uniform verify batch that
    vLLM captures as a full CUDA graph, by that length: ``1 + B`` and, under
    vLLM's batch-size schedule (``num_speculative_tokens_per_batch_size``,
    whose every draft length K gets graphs of its own on the V2 runner),
    ``1 + K``. A captured length without buffers would replay the chain
    attention its capture saw over the step's trees. ``K = 0`` (no
    speculation at those batch sizes) gets none: its one-token decode
    batches have no tree and keep the stock kernel; nor does the length of
    the chain steps (``ddtree.chain_from_batch_size``), whose uniform
    batches are never trees and run FlashAttention.

    Every caller with the same settings gets the same buffers: the metadata
    builders of all tree-attention groups (each fill writes the same
    step's inputs) and the V2 runner, whose lay-out launch fills them."""
    spec = vllm_config.speculative_config
    schedule = spec.num_speculative_tokens_per_batch_size or ()
    widths = {1 + spec.num_speculative_tokens} | {1 + k for *_, k in schedule if k}
    cfg = get_ddtree_config(vllm_config)
    if cfg is not None and cfg.chain_length is not None:
        widths.discard(1 + cfg.chain_length)
    # A padded graph batch has at most one request per token.
    max_num_reqs = max(
        vllm_config.scheduler_config.max_num_seqs,
        vllm_config.compilation_config.max_cudagraph_capture_size or 0,
    )
    key = (
        tuple(sorted(widths)),
        max_num_reqs,
        vllm_config.model_config.max_model_len,
        torch.device(device),
    )
    buffers = _UNIFORM_BUFFERS.get(key)
    if buffers is None:
        widths, max_num_reqs, max_model_len, device = key
        buffers = _UNIFORM_BUFFERS[key] = {
            n: UniformTreeBuffers(max_num_reqs, n, max_model_len, device)
            for n in widths
        }
    return buffers


_UNIFORM_BUFFERS: dict[tuple, dict[int, UniformTreeBuffers]] = {}


class TreeMetadataBuilderMixin:
    """Mixed into a backend's metadata builder: attaches the published tree,
    and the block-table rows of its requests (gathered once per step rather
    than in every layer).

    Only causal target batches carry trees; the DFlash drafter's non-causal
    batches never do. A builder whose uniform batches replay as full CUDA
    graphs sets :attr:`uniform_trees` (graph buffers by query length, see
    :func:`uniform_tree_buffers`); those batches then get the graph buffers'
    description instead.
    """

    uniform_trees: dict[int, UniformTreeBuffers] | None = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        causal = cm.causal is True
        tree = current_tree() if causal else None
        buffers = self._uniform_buffers(cm) if causal else None
        if self._skips_stock_pass(tree, buffers):
            # TreeAttentionImplMixin.forward runs no stock kernel on this
            # batch: plan none of its extras (with FlashAttention 3, its
            # ahead-of-time schedule: a launch and two copies a step, every
            # decode step of a tree batch; a cascade's shared prefix).
            common_prefix_len, fast_build = 0, True
        metadata = super().build(common_prefix_len, cm, fast_build)
        self._attach_tree(metadata, cm, tree, buffers)
        return metadata

    def _skips_stock_pass(
        self, tree: TreeAttentionInfo | None, buffers: UniformTreeBuffers | None
    ) -> bool:
        """Whether the tree rows cover the batch (a uniform batch's buffers
        describe every row, see :meth:`UniformTreeBuffers.fill`), so that
        the attention runs no stock kernel."""
        return buffers is not None or (tree is not None and tree.covers_batch)

    def _attach_tree(
        self,
        metadata,
        common_attn_metadata,
        tree: TreeAttentionInfo | None,
        buffers: UniformTreeBuffers | None,
    ) -> bool:
        """Set ``metadata.tree`` and, for a tree, ``tree_block_table``;
        return whether the batch went through :attr:`uniform_trees`
        (``buffers``: :meth:`_uniform_buffers` of a causal batch)."""
        cm = common_attn_metadata
        if buffers is not None:
            metadata.tree = buffers.fill(cm.num_reqs, cm.seq_lens, tree)
            # Rows are the batch's requests in order: the backend's own table.
            metadata.tree_block_table = metadata.block_table
            return True
        metadata.tree = tree
        if tree is None:
            return False
        if tree.req_rows_cpu == list(range(len(tree.req_rows_cpu))):
            # The batch's first rows in order (e.g. every row, a mixed
            # step's prompts as chains): the backend's own table.
            metadata.tree_block_table = metadata.block_table
        else:
            metadata.tree_block_table = metadata.block_table.index_select(
                0, tree.req_rows
            )
        return False

    def _uniform_buffers(self, common_attn_metadata) -> UniformTreeBuffers | None:
        """The graph buffers of a uniform batch's query length, if it is one."""
        if not self.uniform_trees:
            return None
        offsets = common_attn_metadata.query_start_loc_cpu
        longest = int(np.diff(offsets.numpy()).max(initial=0))
        buffers = self.uniform_trees.get(longest)
        return buffers if buffers is not None and buffers.matches(offsets) else None


class TreeAttentionImplMixin:
    """Mixed into a backend's attention impl: the stock kernel runs over the
    whole batch, then :meth:`_tree_forward` overwrites the tree rows. When
    the batch is nothing but trees (steady-state decoding) the stock kernel is
    skipped: both backends write the KV cache outside ``forward``.

    Subclasses provide ``kv_layout(kv_cache)`` and ``_tree_forward``.
    """

    def forward(
        self,
        layer,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        output,
        output_scale=None,
        output_block_scale=None,
    ):
        tree: TreeAttentionInfo | None = getattr(attn_metadata, "tree", None)
        if self.attn_type != AttentionType.DECODER:
            tree = None
        if tree is not None:
            if self.alibi_slopes is not None or self.logits_soft_cap:
                raise NotImplementedError(
                    "tree attention supports plain causal attention only "
                    "(no ALiBi or soft-cap)"
                )
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError(
                    "tree attention has no fused output quantization"
                )
        if tree is None or not tree.covers_batch:
            result = super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale=output_scale,
                output_block_scale=output_block_scale,
            )
            if tree is None:
                return result
        self._tree_forward(query, key, value, kv_cache, attn_metadata, tree, output)
        return output

    def copy_kv_slots(
        self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """``cache[dst[i]] = cache[src[i]]`` (the accepted path's commit)."""
        self.kv_layout(kv_cache).copy_slots(kv_cache, src, dst)

    def kv_commit_for_layers(
        self, kv_caches: list[torch.Tensor]
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
        """A commit ``(slot_mapping, roots, path)`` of the accepted paths
        in all ``kv_caches`` (one KV-cache group's layers) at once (see
        :class:`~vllm_ddtree.v1.ops.triton_kv_commit.SlotRowsCommit`), or
        ``None``: the runner then calls :meth:`copy_kv_slots` layer by
        layer."""
        return None


class PagedKVLayout:
    """Element index of every key / value entry inside one cache block.

    ``key_index[h, off, d]`` (and ``value_index``) is the flat index, within
    block ``b``'s storage ``storage[b]``, of head ``h``, in-block offset
    ``off`` and channel ``d``. All blocks share the same map.
    """

    def __init__(
        self,
        key_index: torch.Tensor,
        value_index: torch.Tensor,
        block_size: int,
    ) -> None:
        self.key_index = key_index
        self.value_index = value_index
        self.block_size = block_size

    @classmethod
    def from_strides(cls, key_cache: torch.Tensor, value_cache: torch.Tensor):
        """Layout of caches addressable as ``[block, offset, head, dim]`` views."""
        _, block_size, num_heads, head_size = key_cache.shape
        assert key_cache.stride(0) == value_cache.stride(0)

        def index(view: torch.Tensor, base: int) -> torch.Tensor:
            s = view.stride()
            h = torch.arange(num_heads)[:, None, None] * s[2]
            o = torch.arange(block_size)[None, :, None] * s[1]
            d = torch.arange(head_size)[None, None, :] * s[3]
            return (h + o + d + base).to(key_cache.device)

        offset = value_cache.storage_offset() - key_cache.storage_offset()
        return cls(index(key_cache, 0), index(value_cache, offset), block_size)

    def _block_storage(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, elements_per_block]`` view of the cache storage."""
        stride = kv_cache.stride(0)
        return kv_cache.as_strided((kv_cache.shape[0], stride), (stride, 1))

    def _where(self, index: torch.Tensor, slots: torch.Tensor):
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        offsets = slots - blocks * self.block_size
        return blocks[:, None, None], index[:, offsets, :].transpose(0, 1)

    def gather(
        self, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[len(slots), heads, head_size]`` of cache slots."""
        storage = self._block_storage(kv_cache)
        return (
            storage[self._where(self.key_index, slots)],
            storage[self._where(self.value_index, slots)],
        )

    def copy_slots(
        self, kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """``cache[dst[i]] = cache[src[i]]`` for keys and values.

        All sources are read before any destination is written, so
        overlapping source and destination sets are fine.
        """
        storage = self._block_storage(kv_cache)
        for index in (self.key_index, self.value_index):
            storage[self._where(index, dst)] = storage[self._where(index, src)]


def pack_ancestor_mask(
    mask: torch.Tensor, num_nodes: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit-pack the valid rows of ``[R, N, N]`` masks for the Triton kernel.

    Returns ``(packed [sum(num_nodes), ceil(N / 32)] int32, row_start [R]
    int32)``: row ``row_start[r] + i`` holds node ``i`` of request ``r``,
    bit ``j % 32`` of word ``j // 32`` set iff node ``j`` is visible.
    ``num_nodes`` is a host list, so no device sync is needed.
    """
    num_reqs, n, _ = mask.shape
    words = (n + 31) // 32
    bits = torch.zeros(num_reqs, n, words * 32, dtype=torch.int64, device=mask.device)
    bits[:, :, :n] = mask.long()
    weights = 1 << torch.arange(32, device=mask.device, dtype=torch.int64)
    packed = (bits.view(num_reqs, n, words, 32) * weights).sum(dim=-1)
    # Two's-complement view of the 32-bit words (bit 31 becomes the sign).
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    rows = np.repeat(np.arange(num_reqs), num_nodes)
    nodes = np.concatenate([np.arange(k) for k in num_nodes])
    starts = np.cumsum(num_nodes) - np.asarray(num_nodes)
    device = mask.device
    flat = packed[torch.from_numpy(rows).to(device), torch.from_numpy(nodes).to(device)]
    return flat, torch.from_numpy(starts.astype(np.int32)).to(device)


def torch_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: PagedKVLayout,
    tree_block_table: torch.Tensor,
    tree: TreeAttentionInfo,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Tree attention for the tree rows of a batch, in float32 torch.

    ``query`` is ``[T, Hq, D]`` and ``key`` / ``value`` ``[T, Hkv, D]`` (this
    step's tokens); the context comes from the paged ``kv_cache``. Writes
    ``out[q_start + i]`` (``[T, Hq, D]``) for every tree node ``i``; every
    other row of ``out`` is left alone. All tree requests are processed in one
    padded batch: ``R`` requests x ``N`` nodes x ``C`` context positions.
    """
    device = query.device
    num_reqs = len(tree.req_rows_cpu)
    n = tree.max_nodes
    c = tree.max_ctx_len
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads

    node = torch.arange(n, device=device)
    node_valid = node[None, :] < tree.num_nodes[:, None]
    tokens = (tree.q_start[:, None] + node[None, :]).long()
    tokens = torch.where(node_valid, tokens, tree.q_start[:, None].long())

    pos = torch.arange(c, device=device)
    ctx_valid = pos[None, :] < tree.ctx_len[:, None]
    blocks = torch.gather(
        tree_block_table, 1, (pos // layout.block_size).expand(num_reqs, c)
    )
    slots = blocks.long() * layout.block_size + pos % layout.block_size
    slots = torch.where(ctx_valid, slots, 0)
    ctx_k, ctx_v = layout.gather(kv_cache, slots.flatten())

    def keys_of(ctx: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        # [R, Hkv, C + N, D]
        ctx = ctx.view(num_reqs, c, num_kv_heads, head_size)
        return torch.cat([ctx, fresh[tokens]], dim=1).float().transpose(1, 2)

    k, v = keys_of(ctx_k, key), keys_of(ctx_v, value)
    # [R, Hkv, N * group, D]: the query heads sharing a KV head side by side.
    q = query[tokens].float().view(num_reqs, n, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, n * group, -1)
    visible = torch.cat(
        [ctx_valid[:, None, :].expand(num_reqs, n, c), tree.mask[:, :n, :n]], dim=2
    )
    visible = visible.repeat_interleave(group, dim=1)[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    result = torch.matmul(scores.softmax(dim=-1), v)
    result = result.view(num_reqs, num_kv_heads, n, group, head_size)
    result = result.permute(0, 2, 1, 3, 4).reshape(num_reqs, n, num_heads, head_size)
    out[tokens[node_valid]] = result[node_valid].to(out.dtype)
