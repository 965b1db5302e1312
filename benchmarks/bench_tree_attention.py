"""Benchmark the Triton tree-attention kernel on a GPU (Qwen3-8B heads).

For each (batch, context, tree size) it times

* ``ours``: :func:`tree_attention` over vLLM's FlashAttention-layout paged
  cache (random trees, every row the same shape);
* ``fa3``: vLLM's FlashAttention (``vllm.vllm_flash_attn``) causal attention
  over the same number of query tokens arranged as a chain, on the same paged
  cache (column skipped when it cannot be imported);
* ``fa3+tree``: the alternative design, FlashAttention non-causal over the
  context returning its log-sum-exp, then our kernel over the tree nodes
  continuing that softmax state in place (``context_lse``); with its largest
  deviation from ``ours`` (``fa3_tree_err``) and the context pass alone
  (``fa3 ctx``; the difference is the tree pass);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a
  materialised boolean mask over pre-gathered contiguous KV (gather not
  timed);

and reports, for ``ours`` and for the better of the two tree designs
(``best``), the fraction of the roofline reached: the roofline time is the
larger of the bytes the kernel must move (KV, queries, outputs) over the
measured device copy bandwidth (bytes read + written of a large ``copy_``)
and the FLOPs a tree needs (every node against the whole context, its
ancestors and itself) over the measured bf16 matmul throughput. Trees of 64
nodes and more are compute-bound on an H200 (each KV head serves
``nodes x q_heads / kv_heads`` query rows), so a bandwidth-only fraction
would understate them. The markdown table (``--out`` with ``.md``) is the
one in ``docs/benchmarks/tree_attention.md``.

Usage (GPU)::

    python benchmarks/bench_tree_attention.py
    python benchmarks/bench_tree_attention.py --batches 1,8 --contexts 4096 \
        --trees 16,64 --out /tmp/ta.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_ddtree.v1.attention.ops.flash_context_tree_attention import (  # noqa: E402
    flash_context_pass,
    flash_context_tree_attention,
)
from vllm_ddtree.v1.attention.ops.triton_tree_attention import (  # noqa: E402
    _pick_tiles,
    choose_num_splits,
    tree_attention,
)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _bench(fn, warmup_ms: int, rep_ms: int) -> float:
    import triton.testing

    return float(
        triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    )


_FLUSH: torch.Tensor | None = None


def _bench_graph(fn, reps: int = 10, replays: int = 7) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph, L2 cold every call.

    The graph holds ``reps`` x (256 MiB L2-flushing memset, ``fn``); a second
    graph holds the memsets alone, and its time is subtracted.  This removes
    host launch overhead (as under vLLM's CUDA graphs) without letting small
    problems run from L2.
    """
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm up outside the capture
        torch.cuda.synchronize()
        graphs = []
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(reps):
                    _FLUSH.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for g in graphs:
        g.replay()  # warm
        samples = []
        for _ in range(replays):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        times.append(sorted(samples)[len(samples) // 2])
    del graphs
    return max(times[0] - times[1], 1e-6) / reps


def _reps(ms: float) -> int:
    """Calls per captured graph: about 20 ms of work, 1..10 calls."""
    return max(1, min(10, int(20.0 / max(ms, 1e-3))))


def _time(fn, args, warmup_ms: int | None = None, rep_ms: int | None = None):
    """``(eager ms, ms)``: ``do_bench``'s median, then a CUDA-graph replay
    (the eager time again under ``--eager``)."""
    eager = _bench(
        fn,
        args.warmup if warmup_ms is None else warmup_ms,
        args.rep if rep_ms is None else rep_ms,
    )
    return eager, eager if args.eager else _bench_graph(fn, _reps(eager))


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), 50, 300)
    return 2 * nbytes / (ms * 1e-3)


def measure_matmul_flops(size: int = 8192) -> float:
    """Device bf16 matmul throughput in FLOP/s (a square ``size`` GEMM)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    ms = _bench(lambda: a @ b, 50, 300)
    return 2 * size**3 / (ms * 1e-3)


def roofline_ms(nbytes: int, flops: int, args: argparse.Namespace) -> tuple:
    """``(ms, bound)``: the time the device needs at least to move ``nbytes``
    and to compute ``flops``, and which of the two bounds it."""
    memory = nbytes / args.copy_bw * 1e3
    compute = flops / args.matmul_flops * 1e3
    return max(memory, compute), "memory" if memory >= compute else "compute"


def _random_masks(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Packed ancestor masks of ``batch`` random trees, ``[batch*n, words]``."""
    words = (n + 31) // 32
    out = torch.zeros(batch * n, words, dtype=torch.int64)
    for b in range(batch):
        anc: list[int] = []
        for i in range(n):
            p = -1 if i == 0 else int(torch.randint(0, i, (1,), generator=gen))
            anc.append((anc[p] if p >= 0 else 0) | (1 << i))
        for i, a in enumerate(anc):
            for w in range(words):
                out[b * n + i, w] = (a >> (32 * w)) & 0xFFFFFFFF
    out = torch.where(out >= 2**31, out - 2**32, out)
    return out.to(torch.int32)


def _popcount(words: torch.Tensor) -> torch.Tensor:
    """Set bits of each 32-bit word (int32 storage, sign bit included)."""
    bits = words.long() & 0xFFFFFFFF
    return sum((bits >> i) & 1 for i in range(32))


def summarize(rec: dict) -> dict:
    """Derived columns of one record: the roofline fraction of ``ours``; the
    better of the fused kernel and FA3 + tree pass (``best``), its roofline
    fraction and its time over FA3's causal chain of the same length."""
    out = dict(rec)
    if "ours_ms" in rec and "roofline_ms" in rec:
        out["roofline_frac"] = rec["roofline_ms"] / rec["ours_ms"]
    paths = {k: rec[f"{k}_ms"] for k in ("ours", "fa3_tree") if f"{k}_ms" in rec}
    if paths:
        out["best"] = min(paths, key=paths.get)
        out["best_ms"] = paths[out["best"]]
        if "roofline_ms" in rec:
            out["best_roofline_frac"] = rec["roofline_ms"] / out["best_ms"]
        if "fa3_ms" in rec:
            out["best_vs_chain"] = out["best_ms"] / rec["fa3_ms"]
    return out


def markdown_table(results: list[dict]) -> str:
    """The table of ``docs/benchmarks/tree_attention.md`` (times in µs)."""

    def us(ms) -> str:
        return _fmt(ms * 1e3 if ms is not None else None, ".1f")

    lines = [
        "| batch | context | nodes | fused | FA3 + tree | FA3 chain | best / chain "
        "| SDPA | bound | roofline, fused | roofline, best |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['tree']} | {us(r.get('ours_ms'))} "
            f"| {us(r.get('fa3_tree_ms'))} | {us(r.get('fa3_ms'))} "
            f"| {_fmt(r.get('best_vs_chain'), '.2f')} | {us(r.get('sdpa_ms'))} "
            f"| {r.get('bound', '-')} | {_fmt(r.get('roofline_frac'), '.0%')} "
            f"| {_fmt(r.get('best_roofline_frac'), '.0%')} |"
        )
    return "\n".join(lines)


def run_config(
    batch: int,
    ctx: int,
    n: int,
    args: argparse.Namespace,
    fa_fn,
) -> dict:
    hq, hkv, d, page = args.q_heads, args.kv_heads, args.head_dim, args.page
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    gen = torch.Generator().manual_seed(batch * 1_000_003 + ctx * 31 + n)
    rec: dict = {"batch": batch, "ctx": ctx, "tree": n}
    total = ctx + n
    blocks_per_row = math.ceil(total / page)
    num_blocks = batch * blocks_per_row + 1
    elt = torch.finfo(dtype).bits // 8
    kv_bytes = batch * total * hkv * d * 2 * elt
    q_bytes = 2 * batch * n * hq * d * elt  # query read + output written
    rec["kv_bytes"] = kv_bytes
    scale = 1.0 / math.sqrt(d)

    kv = torch.empty(num_blocks, page, hkv, 2 * d, dtype=dtype, device=dev)
    kv.normal_()
    kv = kv.transpose(1, 2)  # logical (blocks, Hkv, page, 2D), vLLM FA layout
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
    perm = torch.randperm(num_blocks - 1, generator=gen).to(dev) + 1
    block_table = perm.view(batch, blocks_per_row).to(torch.int32).contiguous()
    query = torch.randn(batch * n, hq, d, dtype=dtype, device=dev)
    out = torch.empty_like(query)
    i32 = dict(dtype=torch.int32, device=dev)
    q_start = torch.arange(batch, **i32) * n
    num_nodes = torch.full((batch,), n, **i32)
    ctx_len = torch.full((batch,), ctx, **i32)
    mask_row_start = q_start.clone()
    tree_mask = _random_masks(batch, n, gen)
    # Query-key pairs a tree needs: every node sees the context, its
    # ancestors and itself (the mask's set bits).
    visible = int(_popcount(tree_mask).sum())
    rec["flops"] = 4 * hq * d * (batch * n * ctx + visible)  # QK^T + PV
    bound = roofline_ms(kv_bytes + q_bytes, rec["flops"], args)
    rec["roofline_ms"], rec["bound"] = bound
    tree_mask = tree_mask.to(dev)

    block_m, block_n, _, _ = _pick_tiles(n * hq // hkv, triton_next_pow2(d))
    q_tiles = math.ceil(n * hq // hkv / block_m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rec["splits"] = choose_num_splits(
        batch * hkv * q_tiles, ctx + n, sms, block_n, block_m
    )

    def ours():
        tree_attention(
            query, key_cache, value_cache, out, block_table, q_start, num_nodes,
            ctx_len, mask_row_start, tree_mask, scale, n, max_ctx_len=ctx + n,
        )  # fmt: skip

    try:
        rec["ours_eager_ms"], ms = _time(ours, args)
        rec["ours_ms"] = ms
        rec["ours_GBps"] = (kv_bytes + q_bytes) / (ms * 1e-3) / 1e9
        rec["ours_TFLOPs"] = rec["flops"] / (ms * 1e-3) / 1e12
    except Exception as exc:  # OOM or launch failure: record and go on
        rec["ours_error"] = repr(exc)[:300]

    if args.sweep and "ours_ms" in rec:
        rec["sweep_ms"] = _sweep_tiles(
            args, query, key_cache, value_cache, out, block_table, q_start,
            num_nodes, ctx_len, mask_row_start, tree_mask, scale, n, ctx,
        )  # fmt: skip
        best = min(rec["sweep_ms"], key=rec["sweep_ms"].get)
        rec["sweep_best"] = best
        rec["sweep_best_ms"] = rec["sweep_ms"][best]

    cu_q = torch.arange(batch + 1, **i32) * n
    if fa_fn is not None:
        try:
            seqused = torch.full((batch,), total, **i32)

            def fa():
                fa_fn(
                    q=query, k=key_cache, v=value_cache, out=out,
                    cu_seqlens_q=cu_q, max_seqlen_q=n, seqused_k=seqused,
                    max_seqlen_k=total, softmax_scale=scale, causal=True,
                    block_table=block_table, fa_version=3,
                )  # fmt: skip

            rec["fa3_eager_ms"], rec["fa3_ms"] = _time(fa, args)
        except Exception as exc:
            rec["fa3_error"] = repr(exc)[:300]

    if fa_fn is not None and "ours_ms" in rec:
        try:
            ours()  # the FA3 chain column wrote ``out`` too
            rec.update(
                _time_fa3_tree(
                    args, query, key_cache, value_cache, block_table, cu_q,
                    num_nodes, ctx_len, mask_row_start, tree_mask, scale, n,
                    ctx, out,
                )
            )  # fmt: skip
        except Exception as exc:
            rec["fa3_tree_error"] = repr(exc)[:300]

    if not args.no_sdpa:
        # Gathered contiguous KV (+ head expansion if SDPA's memory-efficient
        # kernel refuses GQA): skip when that alone would be huge.
        est = 2 * batch * hq * total * d * elt
        if est > args.sdpa_max_gb * 2**30:
            rec["sdpa_error"] = f"skipped: gathered KV {est / 2**30:.1f} GiB"
        else:
            try:
                sd = _time_sdpa(
                    args, batch, ctx, n, key_cache, value_cache, block_table,
                    query, tree_mask, scale,
                )  # fmt: skip
                rec.update(sd)
            except Exception as exc:
                rec["sdpa_error"] = repr(exc)[:300]
            torch.cuda.empty_cache()

    return summarize(rec)  # tensors die with this frame; the caller empties the cache


def _sweep_tiles(
    args, query, key_cache, value_cache, out, block_table, q_start, num_nodes,
    ctx_len, mask_row_start, tree_mask, scale, n, ctx,
) -> dict[str, float]:  # fmt: skip
    """CUDA-graph time of every forced (query tile, split count) variant.

    Keys are ``"<BLOCK_M>x<splits>"``; the data behind ``_pick_tiles`` and
    ``choose_num_splits``.
    """
    times: dict[str, float] = {}
    for block_m in _ints(args.sweep_block_m):
        for splits in _ints(args.sweep_splits):
            if splits > 1 and ctx < splits * 64:
                continue

            def fn(bm: int = block_m, sp: int = splits) -> None:
                tree_attention(
                    query, key_cache, value_cache, out, block_table, q_start,
                    num_nodes, ctx_len, mask_row_start, tree_mask, scale, n,
                    max_ctx_len=ctx + n, num_splits=sp, block_m=bm,
                )  # fmt: skip

            try:
                times[f"{block_m}x{splits}"] = _time(fn, args, 5, 20)[1]
            except Exception as exc:  # e.g. out of shared memory
                print(f"sweep {block_m}x{splits}: {exc!r}"[:200], flush=True)
    return times


def _time_fa3_tree(
    args, query, key_cache, value_cache, block_table, cu_q, num_nodes, ctx_len,
    mask_row_start, tree_mask, scale, n, ctx, ours_out,
) -> dict:  # fmt: skip
    """FlashAttention over the context + the tree pass continuing its state;
    and the context pass alone (``fa3_ctx_ms``: the rest is the tree pass)."""
    merged = torch.empty_like(query)

    def fa3_ctx() -> torch.Tensor:
        return flash_context_pass(
            query, key_cache, value_cache, merged, block_table, ctx_len, scale,
            n, cu_seqlens_q=cu_q, max_ctx_len=ctx,
        )  # fmt: skip

    def fa3_tree():
        flash_context_tree_attention(
            query, key_cache, value_cache, merged, block_table, cu_q[:-1],
            num_nodes, ctx_len, mask_row_start, tree_mask, scale, n,
            cu_seqlens_q=cu_q, max_ctx_len=ctx,
        )  # fmt: skip

    rec = {}
    for name, fn in (("fa3_ctx", fa3_ctx), ("fa3_tree", fa3_tree)):
        rec[f"{name}_eager_ms"], rec[f"{name}_ms"] = _time(fn, args)
    if args.sweep:
        # The tree pass alone in every query tile, from one context pass's
        # state (repeated passes fold the tree in again: same work, and
        # the outputs are not checked).
        ctx_lse = fa3_ctx()
        sweep = rec["tree_pass_sweep_ms"] = {}
        for block_m in _ints(args.sweep_block_m):

            def tree_pass(bm: int = block_m) -> None:
                tree_attention(
                    query, key_cache, value_cache, merged, block_table,
                    cu_q[:-1], num_nodes, ctx_len, mask_row_start, tree_mask,
                    scale, n, context_lse=ctx_lse, block_m=bm,
                )  # fmt: skip

            try:
                sweep[str(block_m)] = _time(tree_pass, args, 5, 20)[1]
            except Exception as exc:  # e.g. out of shared memory
                print(f"tree pass sweep {block_m}: {exc!r}"[:200], flush=True)
    fa3_tree()
    rec["fa3_tree_err"] = (merged.float() - ours_out.float()).abs().max().item()
    return rec


def _time_sdpa(
    args, batch, ctx, n, key_cache, value_cache, block_table, query, tree_mask, scale
) -> dict:
    """Dense-mask SDPA (memory-efficient backend) over pre-gathered KV."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = query.device
    page = key_cache.shape[1]
    hq, d = query.shape[1], query.shape[2]
    total = ctx + n
    pos = torch.arange(total, device=dev)
    blk = block_table[:, pos // page].long()  # [B, L]
    slot = (pos % page).long()[None, :]
    kg = key_cache[blk, slot].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, L, D]
    vg = value_cache[blk, slot].permute(0, 2, 1, 3).contiguous()
    qg = query.view(batch, n, hq, d).transpose(1, 2)
    j = torch.arange(n, device=dev)
    w = tree_mask[:, j // 32].long()
    tree_vis = ((w >> (j % 32)) & 1).bool().view(batch, 1, n, n)
    padded = -(-total // 16) * 16  # the efficient kernel wants aligned rows
    mask = torch.ones(batch, 1, n, padded, dtype=torch.bool, device=dev)
    mask = mask[..., :total]
    mask[..., ctx:] = tree_vis
    f = torch.nn.functional.scaled_dot_product_attention
    rec: dict = {}
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        try:
            f(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True)
            gqa = True
        except RuntimeError:
            g = hq // kg.shape[1]
            kg = kg.repeat_interleave(g, dim=1)
            vg = vg.repeat_interleave(g, dim=1)
            gqa = False
        rec["sdpa_ms"] = _bench(
            lambda: f(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=gqa),
            args.warmup,
            args.rep,
        )
    rec["sdpa_note"] = "efficient backend, " + ("enable_gqa" if gqa else "expanded")
    return rec


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument(
        "--trees",
        default="16,64,65,256",
        help="nodes per tree, root included (a budget B verifies B + 1 nodes: "
        "65 is the B = 64 engine's shape, one node past a 64-node query tile)",
    )
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=25, help="ms")
    ap.add_argument("--rep", type=int, default=100, help="ms")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="report eager do_bench times (default: CUDA-graph replays, cold L2)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time every forced query tile x split count (sweep_ms)",
    )
    ap.add_argument("--sweep-block-m", default="32,64,128,256")
    ap.add_argument("--sweep-splits", default="1,2,3,4,6,8,12")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--sdpa-max-gb", type=float, default=40.0)
    ap.add_argument("--out", default="docs/benchmarks/tree_attention.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tree_attention.py needs a CUDA GPU")

    fa_fn = None
    fa_note = "disabled"
    if not args.no_fa3:
        try:
            from vllm.vllm_flash_attn import flash_attn_varlen_func as fa_fn

            fa_note = "vllm.vllm_flash_attn (fa_version=3)"
        except Exception as exc:
            fa_note = f"unavailable: {exc!r}"[:200]
    args.copy_bw = measure_copy_bandwidth()
    args.matmul_flops = measure_matmul_flops()
    torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    print(
        f"device {props.name}, {props.multi_processor_count} SMs; copy bandwidth "
        f"{args.copy_bw / 1e9:.0f} GB/s (read+write); bf16 matmul "
        f"{args.matmul_flops / 1e12:.0f} TFLOP/s; FA3: {fa_note}",
        flush=True,
    )

    results: list[dict] = []

    def write_json() -> None:
        doc = {
            "device": props.name,
            "num_sms": props.multi_processor_count,
            "copy_bandwidth_Bps": args.copy_bw,
            "matmul_flops": args.matmul_flops,
            "torch": torch.__version__,
            "fa3": fa_note,
            "heads": {"q": args.q_heads, "kv": args.kv_heads, "dim": args.head_dim},
            "page": args.page,
            "dtype": args.dtype,
            "notes": (
                "ours/fa3 *_ms: CUDA-graph replay, L2 flushed before every call "
                "(unless --eager); *_eager_ms: triton do_bench (median, L2 flushed); "
                "ours: Triton tree attention, random trees, FA-layout paged KV; "
                "fa3: causal chain of the same query count; fa3_ctx: FA3 "
                "non-causal over the context with LSE (flash_context_pass); "
                "fa3_tree: that + the tree pass; sdpa: dense bool mask "
                "over pre-gathered KV (gather not timed); roofline_ms: max of "
                "(KV + Q + O bytes) / copy bandwidth and flops / bf16 matmul "
                "throughput (bound says which); flops: QK^T + PV of every node "
                "over the context, its ancestors and itself; roofline_frac / "
                "best_roofline_frac: roofline_ms over ours / best (the faster of "
                "ours and fa3_tree); best_vs_chain: best over fa3."
            ),
            "results": results,
        }
        if os.path.dirname(args.out):
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(markdown_table(results) + "\n")

    hdr = (
        f"{'batch':>5} {'ctx':>6} {'tree':>4} {'split':>5} {'ours ms':>9} "
        f"{'fa3 ms':>9} {'fa3 ctx':>9} {'fa3+tree':>9} {'sdpa ms':>9} "
        f"{'GB/s':>7} {'roofl':>6} {'best':>5} {'TFLOP/s':>8}"
        + (f" {'best variant':>18}" if args.sweep else "")
    )
    print(hdr, flush=True)
    t0 = time.time()
    for batch in _ints(args.batches):
        for ctx in _ints(args.contexts):
            for n in _ints(args.trees):
                try:
                    rec = run_config(batch, ctx, n, args, fa_fn)
                except Exception as exc:  # e.g. OOM while building the batch
                    rec = {"batch": batch, "ctx": ctx, "tree": n}
                    rec["error"] = repr(exc)[:300]
                    traceback.print_exc()
                    torch.cuda.empty_cache()
                torch.cuda.empty_cache()
                results.append(rec)
                write_json()  # keep partial results if interrupted
                print(
                    f"{batch:>5} {ctx:>6} {n:>4} {_fmt(rec.get('splits'), '>5')} "
                    f"{_fmt(rec.get('ours_ms'), '>9.4f')} "
                    f"{_fmt(rec.get('fa3_ms'), '>9.4f')} "
                    f"{_fmt(rec.get('fa3_ctx_ms'), '>9.4f')} "
                    f"{_fmt(rec.get('fa3_tree_ms'), '>9.4f')} "
                    f"{_fmt(rec.get('sdpa_ms'), '>9.4f')} "
                    f"{_fmt(rec.get('ours_GBps'), '>7.0f')} "
                    f"{_fmt(rec.get('roofline_frac'), '>6.2f')} "
                    f"{_fmt(rec.get('best_roofline_frac'), '>5.2f')} "
                    f"{_fmt(rec.get('ours_TFLOPs'), '>8.1f')}"
                    + (
                        f" {rec.get('sweep_best', '-'):>8} "
                        f"{_fmt(rec.get('sweep_best_ms'), '>9.4f')}"
                        if args.sweep
                        else ""
                    ),
                    flush=True,
                )
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    write_json()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
