"""Triton tree attention over vLLM's paged KV cache (DDTree verification step).

One verification step scores, for each request ("tree row"), a small token
tree: node 0 is the root (the last accepted token) and every other node hangs
below an earlier node.  Each query node attends to

* the whole committed context of its request (positions ``0 .. ctx_len-1``),
  which is implicitly visible, and
* the tree nodes that are its ancestors (or itself), given as a packed bit mask.

Both the context and the tree nodes' own keys/values already live in the paged
KV cache: the tree nodes occupy positions ``ctx_len .. ctx_len + n - 1``.

Kernel design (decode-shaped; the bytes are in the context, the queries few):

* One program per ``(query tile, kv split, tree row x kv head)``.  A query tile
  holds ``BLOCK_M`` rows, each a ``(node, q head)`` pair of one tree row that
  shares one KV head (node-major: row ``m`` is node ``m // G``, q head
  ``kv_head * G + m % G``), so every KV tile that is loaded is reused by all
  queries of the tree and all query heads of the GQA group.  The query tile
  is the fastest grid axis, so tiles of the same tree row run together and
  their repeated KV reads hit L2.
* Context KV tiles of ``BLOCK_N`` positions are streamed through an online
  softmax (base 2) without any masking; the tail of the context and the tree
  nodes are handled by a masked loop that reads the ancestor bits and stops
  at the query tile's last node (nodes are in topological order).
* Split-KV: when ``rows * kv_heads * query_tiles`` programs cannot fill the
  GPU (small batches) and the context is long, the context of every row is
  cut into ``num_splits`` chunks (multiples of ``BLOCK_N``, at least
  ``_MIN_CHUNK`` positions, computed in-kernel from each row's own context
  length).  Each split writes a float32 partial output with its log-sum-exp,
  and a reduce kernel (one program per row, node and block of q heads, an
  online log-sum-exp over the splits) merges them.  Splits are sized to
  fill exactly one wave of resident programs (see
  :func:`choose_num_splits`).  No host synchronisation is needed: the number
  of splits depends only on host-side integers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel

__all__ = ["TreePass", "tree_attention", "choose_num_splits"]

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Smallest context chunk (positions) handed to one split.
_MIN_CHUNK = 128
_MAX_SPLITS = 64
# q heads merged by one reduce program: enough work per program to hide the
# loads' latency, enough programs to spread a batch-1 tree over the GPU.
_REDUCE_HEADS = 8

_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    start,
    ctx_len,
    total_len,
    node,
    row_valid,
    mask_row0,
    offs_n,
    offs_d,
    bt_row_ptr,
    stride_btc,
    k_base,
    v_base,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    tm_ptr,
    stride_tmr,
    stride_tmw,
    qk_scale,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Fold one KV tile (positions ``start + offs_n``) into the softmax state."""
    pos = start + offs_n
    d_ok = offs_d < HEAD_DIM
    if MASKED:
        in_range = pos < total_len
        blk = tl.load(bt_row_ptr + (pos // PAGE) * stride_btc, mask=in_range, other=0)
        kv_mask = in_range[:, None] & d_ok[None, :]
    else:
        blk = tl.load(bt_row_ptr + (pos // PAGE) * stride_btc)
        kv_mask = (pos >= 0)[:, None] & d_ok[None, :]
    blk = blk.to(tl.int64)
    slot = (pos % PAGE).to(tl.int64)
    k_ptrs = (
        k_base
        + (blk * stride_kb + slot * stride_ks)[:, None]
        + offs_d[None, :] * stride_kd
    )
    v_ptrs = (
        v_base
        + (blk * stride_vb + slot * stride_vs)[:, None]
        + offs_d[None, :] * stride_vd
    )
    if MASKED or BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    if DOT_UPCAST:
        # Triton's CPU interpreter multiplies bf16 operands wrongly: upcast.
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    s = s * qk_scale
    if MASKED:
        j = pos - ctx_len  # tree-node index of the key (negative: context)
        is_tree = (j >= 0) & in_range
        jj = tl.maximum(j, 0)
        # The tile's tree keys lie in at most BLOCK_N // 32 + 1 consecutive
        # mask words of each row: load those per row and spread them over
        # the key columns, rather than gathering a word per (row, key),
        # which reads each word 32 times.
        w_first = tl.maximum(start - ctx_len, 0) // 32
        w_rel = jj // 32 - w_first
        row_ptr = tm_ptr + (mask_row0 + node).to(tl.int64) * stride_tmr
        n_words = tl.cdiv(total_len - ctx_len, 32)
        words = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for w in tl.static_range(BLOCK_N // 32 + 1):
            word = tl.load(
                row_ptr + (w_first + w) * stride_tmw,
                mask=row_valid & (w_first + w < n_words),
                other=0,
            )
            words = tl.where((w_rel == w)[None, :], word[:, None], words)
        bit = (words >> (jj % 32)[None, :]) & 1
        visible = ((pos < ctx_len) & in_range)[None, :] | (
            (bit != 0) & is_tree[None, :]
        )
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    p = p.to(v.dtype)
    if DOT_UPCAST:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p, v, acc, input_precision=DOT_PREC)
    return acc, m_new, l_i


# Arguments that change from step to step (split count, tree-size dependent
# strides) are not specialised on: Triton would compile a variant per value
# class in the middle of serving.
@triton.jit(
    do_not_specialize=[
        "num_splits",
        "stride_clh",
        "stride_tmr",
        "stride_ps",
        "stride_lps",
    ]
)
def _tree_attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    O_PART,
    LSE_PART,
    CTX_LSE,
    BLOCK_TABLE,
    Q_START,
    NUM_NODES,
    CTX_LEN,
    MASK_ROW_START,
    TREE_MASK,
    qk_scale,
    num_kv_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    stride_clh,
    stride_clt,
    stride_btr,
    stride_btc,
    stride_tmr,
    stride_tmw,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_lps,
    stride_lpt,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    TREE_ONLY: tl.constexpr,
    SEEDED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    pid_rh = tl.program_id(2)
    r = pid_rh // num_kv_heads
    kvh = pid_rh % num_kv_heads

    n_nodes = tl.load(NUM_NODES + r)
    if pid_m * BLOCK_M >= n_nodes * G:
        return
    q_start = tl.load(Q_START + r)
    ctx_len = tl.load(CTX_LEN + r)
    mask_row0 = tl.load(MASK_ROW_START + r)
    total_len = ctx_len + n_nodes

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    node = offs_m // G
    head = kvh * G + offs_m % G
    row_valid = offs_m < n_nodes * G
    d_ok = offs_d < HEAD_DIM
    io_mask = row_valid[:, None] & d_ok[None, :]

    tok = (q_start + node).to(tl.int64)
    q_ptrs = (
        Q
        + (tok * stride_qt + head.to(tl.int64) * stride_qh)[:, None]
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)

    bt_row_ptr = BLOCK_TABLE + r.to(tl.int64) * stride_btr
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh

    o_ptrs = (
        Out
        + (tok * stride_ot + head.to(tl.int64) * stride_oh)[:, None]
        + offs_d[None, :] * stride_od
    )
    # A finite "minus infinity" for the running max, so that fully masked
    # tiles never compute ``-inf - -inf``.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SEEDED:
        # ``Out`` holds the context's normalised attention and CTX_LSE its
        # log-sum-exp: that is the softmax state (max = LSE, sum = 1) the
        # context loop would have left, so the tree keys continue from it.
        # A non-finite LSE (FlashAttention's +inf, or -inf) means no context.
        c_lse = tl.load(
            CTX_LSE + head.to(tl.int64) * stride_clh + tok * stride_clt,
            mask=row_valid,
            other=float("inf"),
        )
        has_ctx = tl.abs(c_lse) < float("inf")
        m_i = tl.where(has_ctx, c_lse * 1.4426950408889634, m_i)  # log2(e)
        l_i = tl.where(has_ctx, 1.0, l_i)
        acc = tl.load(o_ptrs, mask=io_mask & has_ctx[:, None], other=0.0).to(tl.float32)

    # Context positions in whole tiles need no mask.  Split ``split`` owns
    # the whole tiles of [split * chunk, (split + 1) * chunk); the split that
    # owns the first partial tile also does the masked tail (context
    # remainder + tree nodes).
    ctx_full = (ctx_len // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, MIN_CHUNK)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx_full)
    tail_split = tl.minimum(ctx_full // chunk, num_splits - 1)
    tail_start = ctx_full
    if TREE_ONLY:
        # The context is someone else's (e.g. FlashAttention's, merged by
        # log-sum-exp afterwards): attend to the tree nodes only.
        hi = lo
        tail_start = ctx_len

    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, ctx_len, total_len, node, row_valid,
            mask_row0, offs_n, offs_d, bt_row_ptr, stride_btc, k_base, v_base,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            TREE_MASK, stride_tmr, stride_tmw, qk_scale,
            PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, False, DOT_PREC, DOT_UPCAST,
        )  # fmt: skip
    if split == tail_split:
        # Node i only sees tree nodes j <= i (ancestors precede descendants),
        # so keys past this tile's last node are skipped.
        last_node = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, n_nodes - 1)
        for start in range(tail_start, ctx_len + last_node + 1, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, start, ctx_len, total_len, node, row_valid,
                mask_row0, offs_n, offs_d, bt_row_ptr, stride_btc, k_base,
                v_base, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                stride_vd, TREE_MASK, stride_tmr, stride_tmw, qk_scale,
                PAGE, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, True, DOT_PREC,
                DOT_UPCAST,
            )  # fmt: skip

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse2 = tl.where(has_mass, m_i + tl.math.log2(l_safe), float("-inf"))
    if SPLIT:
        t_idx = (mask_row0 + node).to(tl.int64)
        p_ptrs = (
            O_PART
            + split.to(tl.int64) * stride_ps
            + (t_idx * stride_pt + head.to(tl.int64) * stride_ph)[:, None]
            + offs_d[None, :]
        )
        tl.store(p_ptrs, out, mask=io_mask)
        lp_ptrs = LSE_PART + split.to(tl.int64) * stride_lps + t_idx * stride_lpt + head
        tl.store(lp_ptrs, lse2, mask=row_valid)
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=io_mask)
        if WRITE_LSE:
            l_ptrs = LSE + tok * stride_lt + head.to(tl.int64) * stride_lh
            tl.store(l_ptrs, lse2 * 0.6931471805599453, mask=row_valid)  # ln(2)


@triton.jit(do_not_specialize=["num_splits", "stride_ps", "stride_lps"])
def _tree_attn_reduce_kernel(
    Out,
    LSE,
    O_PART,
    LSE_PART,
    Q_START,
    NUM_NODES,
    MASK_ROW_START,
    num_splits,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_lps,
    stride_lpt,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Merge the split partials of one (row, node) for ``BLOCK_H`` q heads:
    an online log-sum-exp over the splits, one ``[BLOCK_H, D]`` tile each."""
    r = tl.program_id(0)
    i = tl.program_id(1)
    n_nodes = tl.load(NUM_NODES + r)
    if i >= n_nodes:
        return
    q_start = tl.load(Q_START + r)
    t_idx = (tl.load(MASK_ROW_START + r) + i).to(tl.int64)

    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_q_heads
    hd_ok = h_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    lse_ptrs = LSE_PART + t_idx * stride_lpt + offs_h
    part_ptrs = (
        O_PART + t_idx * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :]
    )
    m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    wsum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        # Empty splits (lse = -inf) weigh 0.
        lse = tl.load(lse_ptrs + s * stride_lps, mask=h_ok, other=float("-inf"))
        part = tl.load(part_ptrs + s * stride_ps, mask=hd_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * w[:, None]
        wsum = wsum * alpha + w
        m = m_new
    has_mass = wsum > 0.0
    w_safe = tl.where(has_mass, wsum, 1.0)
    out = acc / w_safe[:, None]
    tok = (q_start + i).to(tl.int64)
    tl.store(
        Out
        + tok * stride_ot
        + offs_h[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(Out.dtype.element_ty),
        mask=hd_ok,
    )
    if WRITE_LSE:
        ln_lse = (m + tl.math.log2(w_safe)) * 0.6931471805599453
        tl.store(
            LSE + tok * stride_lt + offs_h * stride_lh,
            tl.where(has_mass, ln_lse, float("-inf")),
            mask=h_ok,
        )


def _pick_tiles(
    rows_per_tree: int, head_dim_p2: int, block_m: int | None = None
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``rows`` = nodes * G.

    Chosen from H200 sweeps (bf16, D=128, page 16; ``bench_tree_attention.py
    --sweep``): up to 512 rows (trees of up to 128 nodes at G = 4), query
    tiles of at most 64 rows win at every batch size (at batch 1 a 65-node
    tree took 34-37 us in 64-row tiles against 64 us in one 256-row tile plus
    a 4-row one), because more, smaller programs fill the GPU where one
    wide tile serialises the context.  Bigger trees keep wide tiles (256 x 64,
    8 warps; compute-bound).  ``block_m`` forces the query tile (a power of
    two in 16..256; tuning sweeps).
    """
    if block_m is None:
        block_m = 16
        cap = 64 if rows_per_tree <= 512 else 256
        while block_m < rows_per_tree and block_m < cap:
            block_m *= 2
    if head_dim_p2 >= 256:
        block_m = min(block_m, 64)
        return block_m, 32, 4, 2
    if block_m <= 64:
        return block_m, 64, 4, 2
    if block_m == 128:
        return 128, 128, 8, 3
    return 256, 64, 8, 3


def _programs_per_sm(block_m: int) -> int:
    """How many programs of a tile shape one SM runs at once (measured)."""
    return 2 if block_m <= 64 else 1


def choose_num_splits(
    num_programs: int, max_ctx_len: int, num_sms: int, block_n: int, block_m: int = 64
) -> int:
    """Heuristic split-KV factor.

    Split only when the grid without splitting leaves resident-program slots
    empty; use as many splits as fit in ONE wave (a partial second wave
    costs more than it gains), and never give a split fewer than
    ``_MIN_CHUNK`` context positions.
    """
    slots = num_sms * _programs_per_sm(block_m)
    if num_programs * 2 > slots or max_ctx_len <= 2 * _MIN_CHUNK:
        return 1
    want = slots // num_programs
    by_len = triton.cdiv(max_ctx_len, max(_MIN_CHUNK, block_n))
    return max(1, min(want, by_len, _MAX_SPLITS))


class _Launches:
    """Launches of one Triton kernel whose compile-time arguments and grid
    are fixed, e.g. a tree pass in every attention layer of a step.

    Triton's dispatch (``kernel[grid](...)``) specialises every argument and
    looks the variant up before each launch: tens of microseconds of host
    time at this kernel's fifty arguments, paid in every layer of a step
    that runs attention eagerly (prefills beside the trees). After the first
    launch with a given ``key`` (whatever in the arguments may change the
    variant: the layer-dependent tensors' dtypes, strides and 16-byte
    alignment), later launches call the compiled variant directly.
    """

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict, **options) -> None:
        self.fn = fn
        self.grid = grid
        self.kwargs = {**constexprs, **options}
        self.constexprs = tuple(constexprs)
        self.trailing = tuple(constexprs.values())
        self.runners: dict[tuple, Callable] = {}

    def __call__(self, key: tuple, args: list) -> None:
        runner = self.runners.get(key)
        if runner is not None:
            runner(*args, *self.trailing)
            return
        kernel = self.fn[self.grid](*args, **self.kwargs)
        # Triton's interpreter returns no compiled kernel: it dispatches each time.
        if isinstance(kernel, CompiledKernel):
            # A compiled kernel takes every argument in signature order.
            assert self.constexprs == _trailing_constexprs(self.fn)
            self.runners[key] = kernel[self.grid]


@functools.cache
def _trailing_constexprs(fn) -> tuple[str, ...]:
    """Names of ``fn``'s compile-time parameters, which must be its last."""
    names = [p.name for p in fn.params]
    num = len(fn.constexprs)
    assert sorted(fn.constexprs) == list(range(len(names) - num, len(names)))
    return tuple(names[len(names) - num :])


def _variant_key(*tensors: torch.Tensor | None) -> tuple:
    """What of ``tensors`` may select another compiled variant of a kernel:
    dtype, strides and 16-byte alignment."""
    return tuple(
        None if t is None else (t.dtype, t.stride(), t.data_ptr() % 16 == 0)
        for t in tensors
    )


class TreePass:
    """Tree attention over one batch's trees, for every layer of a geometry.

    The constructor takes :func:`tree_attention`'s arguments (the first
    layer's tensors stand for every layer's) and makes the choices that do
    not depend on the layer: tiles, split-KV factor, grids and the split
    scratch, which all layers reuse (their passes run one after another on
    the stream). Each call then runs the pass of one layer: its query,
    caches, output and, where planned, log-sum-exp buffers, of the same
    shapes as the first layer's. A metadata builder's batch keeps one per
    step, so a step with eager attention pays the planning and Triton's
    dispatch once rather than per layer (see :class:`_Launches`).
    """

    def __init__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        block_table: torch.Tensor,
        q_start: torch.Tensor,
        num_nodes: torch.Tensor,
        ctx_len: torch.Tensor,
        mask_row_start: torch.Tensor,
        tree_mask: torch.Tensor,
        softmax_scale: float,
        max_nodes: int,
        *,
        max_ctx_len: int | None = None,
        num_splits: int | None = None,
        lse: torch.Tensor | None = None,
        tree_only: bool = False,
        context_lse: torch.Tensor | None = None,
        block_m: int | None = None,
    ) -> None:
        _, num_q_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        page = key_cache.shape[1]
        assert key_cache.shape[3] == head_dim and value_cache.shape == key_cache.shape
        assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
        assert out.shape == query.shape
        assert key_cache.dtype == query.dtype and value_cache.dtype == query.dtype
        group = num_q_heads // num_kv_heads
        num_rows = num_nodes.shape[0]
        self.empty = num_rows == 0 or max_nodes <= 0
        if self.empty:
            return

        block_d = triton.next_power_of_2(head_dim)
        block_m, block_n, num_warps, num_stages = _pick_tiles(
            max_nodes * group, block_d, block_m
        )
        q_tiles = triton.cdiv(max_nodes * group, block_m)
        if context_lse is not None:
            tree_only = True
        if tree_only:
            num_splits = 1
        elif num_splits is None:
            if max_ctx_len is None:
                max_ctx_len = block_table.shape[1] * page
            num_splits = choose_num_splits(
                num_rows * num_kv_heads * q_tiles,
                max_ctx_len,
                _num_sms(query.device),
                block_n,
                block_m,
            )
        num_splits = max(1, int(num_splits))
        self.split = split = num_splits > 1
        # Without splits the scratch arguments are unused: any tensor of the
        # output's dtype (a variant compiled for another would not match the
        # start-up warm-up's).
        self.o_part = self.lse_part = out
        if split:
            t_tree = tree_mask.shape[0]
            self.o_part = torch.empty(
                (num_splits, t_tree, num_q_heads, block_d),
                dtype=torch.float32,
                device=query.device,
            )
            self.lse_part = torch.empty(
                (num_splits, t_tree, num_q_heads),
                dtype=torch.float32,
                device=query.device,
            )
        self.writes_lse = lse is not None
        self.seeded = context_lse is not None
        self.tree_args = (
            block_table,
            q_start,
            num_nodes,
            ctx_len,
            mask_row_start,
            tree_mask,
            softmax_scale * _LOG2E,
            num_kv_heads,
            num_splits,
        )
        self.table_args = (*block_table.stride(), *tree_mask.stride())
        self.part_strides = (
            (*self.o_part.stride()[:3], *self.lse_part.stride()[:2])
            if split
            else (0,) * 5
        )
        self.fwd = _Launches(
            _tree_attn_fwd_kernel,
            (q_tiles, num_splits, num_rows * num_kv_heads),
            dict(
                PAGE=page,
                G=group,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                MIN_CHUNK=max(_MIN_CHUNK, block_n),
                SPLIT=split,
                WRITE_LSE=self.writes_lse,
                TREE_ONLY=tree_only,
                SEEDED=self.seeded,
                DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
                DOT_UPCAST=_INTERPRET and query.dtype == torch.bfloat16,
            ),
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if split:
            block_h = min(triton.next_power_of_2(num_q_heads), _REDUCE_HEADS)
            self.reduce_args = (
                q_start,
                num_nodes,
                mask_row_start,
                num_splits,
                num_q_heads,
            )
            self.reduce = _Launches(
                _tree_attn_reduce_kernel,
                (num_rows, max_nodes, triton.cdiv(num_q_heads, block_h)),
                dict(
                    HEAD_DIM=head_dim,
                    BLOCK_D=block_d,
                    BLOCK_H=block_h,
                    WRITE_LSE=self.writes_lse,
                ),
                num_warps=4,
            )

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        context_lse: torch.Tensor | None = None,
    ) -> None:
        """One layer's pass; writes ``out`` (and ``lse``) in place. ``lse``
        and ``context_lse`` are given exactly when they were planned."""
        if self.empty:
            return
        assert (lse is not None) == self.writes_lse
        assert (context_lse is not None) == self.seeded
        lse_arg = out if lse is None else lse
        lse_strides = (0, 0) if lse is None else lse.stride()
        ctx_strides = (0, 0) if context_lse is None else context_lse.stride()
        key = _variant_key(query, key_cache, value_cache, out, lse, context_lse)
        self.fwd(
            key,
            [
                query,
                key_cache,
                value_cache,
                out,
                lse_arg,
                self.o_part,
                self.lse_part,
                lse_arg if context_lse is None else context_lse,
                *self.tree_args,
                *query.stride(),
                *key_cache.stride(),
                *value_cache.stride(),
                *out.stride(),
                *lse_strides,
                *ctx_strides,
                *self.table_args,
                *self.part_strides,
            ],
        )
        if self.split:
            self.reduce(
                key,
                [
                    out,
                    lse_arg,
                    self.o_part,
                    self.lse_part,
                    *self.reduce_args,
                    *out.stride(),
                    *lse_strides,
                    *self.part_strides,
                ],
            )


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    q_start: torch.Tensor,
    num_nodes: torch.Tensor,
    ctx_len: torch.Tensor,
    mask_row_start: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    max_nodes: int,
    return_lse: bool = False,
    *,
    max_ctx_len: int | None = None,
    num_splits: int | None = None,
    lse: torch.Tensor | None = None,
    tree_only: bool = False,
    context_lse: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor | None:
    """Tree attention over a paged KV cache; writes ``out`` in place.

    Shapes (``R`` tree rows, ``T`` query tokens, ``T_tree`` mask rows):

    * ``query``: ``[T, Hq, D]`` (bf16 / fp16 / fp32, any strides).  Row ``r``'s
      ``num_nodes[r]`` nodes are tokens ``q_start[r] .. q_start[r]+n-1``; other
      tokens are neither read nor written.
    * ``key_cache``, ``value_cache``: ``[num_blocks, block_size, Hkv, D]``,
      arbitrary strides (e.g. vLLM's FlashAttention-layout views), same dtype
      as ``query``.  Position ``p`` of row ``r`` is at block
      ``block_table[r, p // block_size]``, slot ``p % block_size``.  The
      context is ``0 .. ctx_len[r]-1``; tree node ``j`` is at
      ``ctx_len[r] + j`` (already written).
    * ``out``: ``[T, Hq, D]``, same dtype as ``query``.
    * ``block_table``: ``[R, max_blocks]`` int32.
    * ``q_start``, ``num_nodes``, ``ctx_len``, ``mask_row_start``: ``[R]`` int32;
      ``1 <= num_nodes[r] <= max_nodes``.
    * ``tree_mask``: ``[T_tree, ceil(max_nodes / 32)]`` int32; row
      ``mask_row_start[r] + i`` holds node ``i``'s visible tree nodes (bit
      ``j % 32`` of word ``j // 32``; ancestors and itself).  Nodes must be
      in topological order (a node's ancestors have smaller indices): bits
      ``j > i`` are ignored.  Mask rows of different nodes must be distinct
      (they index the split-KV scratch).
    * GQA: q head ``h`` reads kv head ``h // (Hq // Hkv)``.

    Args:
        softmax_scale: scale applied to ``q . k``.
        max_nodes: host-side upper bound of ``num_nodes`` (sizes the grid).
        return_lse: also return the natural-log log-sum-exp, ``[T, Hq]``
            float32 (entries of tokens outside the tree rows are undefined).
        max_ctx_len: optional host-side upper bound of ``ctx_len`` for the
            split-KV heuristic (default: the block table's capacity).
        num_splits: force the split-KV factor (``1`` disables splitting).
        lse: optional preallocated ``[T, Hq]`` float32 LSE buffer (implies
            ``return_lse``); any strides (e.g. the transpose of vLLM's
            ``[Hq, T]`` LSE layout).
        tree_only: attend to the tree nodes only, not to the context (for a
            context pass by another kernel, merged by log-sum-exp); no
            split-KV.
        context_lse: ``[Hq, T]`` float32 natural-log LSE of a context pass
            whose normalised output ``out`` already holds (FlashAttention's
            layout and convention: a non-finite entry means no context).
            The tree nodes are folded into that state in place, which merges
            the two passes without a separate kernel (implies ``tree_only``).
        block_m: force the query tile (rows of ``(node, q head)`` pairs per
            program); default: picked from the tree size.

    Returns:
        The LSE tensor if requested, else ``None``.
    """
    if lse is None and return_lse:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    TreePass(
        query,
        key_cache,
        value_cache,
        out,
        block_table,
        q_start,
        num_nodes,
        ctx_len,
        mask_row_start,
        tree_mask,
        softmax_scale,
        max_nodes,
        max_ctx_len=max_ctx_len,
        num_splits=num_splits,
        lse=lse,
        tree_only=tree_only,
        context_lse=context_lse,
        block_m=block_m,
    )(query, key_cache, value_cache, out, lse, context_lse)
    return lse


def compile_variants(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_q_heads: int,
    max_nodes: int,
) -> list[tuple[int, bool]]:
    """Run :func:`tree_attention` once per kernel variant that trees of up
    to ``max_nodes`` nodes can select (one per query-tile size, with and
    without split-KV), so that Triton compiles them at start-up instead of
    in the middle of serving. The caches and ``block_table`` (``[1, W]``, any
    valid block ids) are the engine's; nothing in them is written. The
    context and the tree stay inside the table's ``W`` blocks: a hybrid
    model's attention pages can hold most of a request (a dummy
    Qwen3.5-9B-like engine with ``max_num_seqs=1`` has a two-block table),
    and positions past them would read block ids from beyond the table.

    Returns the ``(BLOCK_M, split)`` variants it ran.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    group = num_q_heads // num_kv_heads
    device, dtype = key_cache.device, key_cache.dtype
    block_d = triton.next_power_of_2(head_dim)
    first_with_tile: dict[int, int] = {}
    for nodes in range(1, max_nodes + 1):
        block_m = _pick_tiles(nodes * group, block_d)[0]
        first_with_tile.setdefault(block_m, nodes)
    ran = []
    page = key_cache.shape[1]
    capacity = block_table.shape[1] * page
    as_i32 = dict(dtype=torch.int32, device=device)
    for block_m, nodes in sorted(first_with_tile.items()):
        query = torch.zeros(nodes, num_q_heads, head_dim, dtype=dtype, device=device)
        ctx_len = max(0, min(2 * page, capacity - nodes))
        for num_splits in (1, 2):
            tree_attention(
                query,
                key_cache,
                value_cache,
                torch.empty_like(query),
                block_table,
                torch.zeros(1, **as_i32),
                torch.full((1,), nodes, **as_i32),
                torch.full((1,), ctx_len, **as_i32),
                torch.zeros(1, **as_i32),
                torch.full((nodes, triton.cdiv(nodes, 32)), -1, **as_i32),
                1.0,
                nodes,
                num_splits=num_splits,
            )
            ran.append((block_m, num_splits > 1))
    return ran
