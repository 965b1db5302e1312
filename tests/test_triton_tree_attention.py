"""CPU tests of the Triton tree-attention kernel (under ``TRITON_INTERPRET=1``).

``TRITON_INTERPRET`` must be set before Triton is imported, and other test
modules may already have imported it, so the kernel runs in one subprocess
(this file executed as a script with ``--worker``) that checks every case
against the float64 reference and prints one JSON line per case.  The pytest
side parses those lines.  Helpers here (random trees, packed masks, paged
batches) are also used by ``tests/gpu/test_tree_attention_gpu.py``.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from dataclasses import dataclass, field

import pytest
import torch

from tests.utils import interpreted_case, interpreter_fixture, print_case
from vllm_ddtree.v1.attention.ops.tree_attention_ref import (
    tree_attention_reference,
    unpack_tree_mask,
)

# ---------------------------------------------------------------------------
# helpers (shared with the GPU tests)
# ---------------------------------------------------------------------------

TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def random_parents(n: int, gen: torch.Generator, kind: str = "random") -> list[int]:
    """Parents in topological order: ``parent[0] = -1``, ``parent[i] < i``."""
    parents = [-1]
    for i in range(1, n):
        if kind == "chain":
            parents.append(i - 1)
        elif kind == "star":
            parents.append(0)
        else:
            parents.append(int(torch.randint(0, i, (1,), generator=gen)))
    return parents


def pack_masks(parents: list[int], num_words: int) -> torch.Tensor:
    """Ancestor-or-self bit masks, ``[n, num_words]`` int32 (bit j%32 of j//32)."""
    n = len(parents)
    anc: list[int] = []
    for i, p in enumerate(parents):
        anc.append((anc[p] if p >= 0 else 0) | (1 << i))
    words = torch.zeros(n, num_words, dtype=torch.int64)
    for i, a in enumerate(anc):
        for w in range(num_words):
            words[i, w] = (a >> (32 * w)) & 0xFFFFFFFF
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


@dataclass
class TreeBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    q_start: torch.Tensor
    num_nodes: torch.Tensor
    ctx_len: torch.Tensor
    mask_row_start: torch.Tensor
    tree_mask: torch.Tensor
    max_nodes: int
    scale: float
    tree_tokens: list[int] = field(default_factory=list)
    parents: list[list[int]] = field(default_factory=list)  # each row's tree

    def args(self, out: torch.Tensor) -> tuple:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            out,
            self.block_table,
            self.q_start,
            self.num_nodes,
            self.ctx_len,
            self.mask_row_start,
            self.tree_mask,
            self.scale,
            self.max_nodes,
        )

    def poisoned_out(self) -> torch.Tensor:
        return torch.full_like(self.query, float("nan"))


def make_batch(
    rows: list[tuple[int, int]],
    *,
    page: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    fa_layout: bool = True,
    interleave: bool = True,
    tree_kinds: tuple[str, ...] = ("random", "chain", "star"),
    extra_max_nodes: int = 0,
) -> TreeBatch:
    """A paged batch of tree rows ``(num_nodes, ctx_len)`` with random data.

    Rows' query tokens are interleaved with unrelated tokens, mask rows are
    shuffled with spare rows between them, KV blocks are assigned from a
    random permutation and every cache byte is random.  With ``fa_layout``
    the caches are views of vLLM's FlashAttention layout (physical
    ``(blocks, page, Hkv, 2*D)``); otherwise plain contiguous tensors.
    """
    gen = torch.Generator().manual_seed(seed)
    max_nodes = max(n for n, _ in rows) + extra_max_nodes
    num_words = (max_nodes + 31) // 32

    # Query token layout: random unrelated tokens before each row.
    q_start, tree_tokens, t = [], [], 0
    for n, _ in rows:
        if interleave:
            t += int(torch.randint(0, 3, (1,), generator=gen))
        q_start.append(t)
        tree_tokens.extend(range(t, t + n))
        t += n
    if interleave:
        t += 2
    num_tokens = t

    # Mask rows: rows placed in a shuffled order, one spare row between.
    order = torch.randperm(len(rows), generator=gen).tolist()
    mask_row_start = [0] * len(rows)
    m = 0
    for r in order:
        m += 1 if interleave else 0
        mask_row_start[r] = m
        m += rows[r][0]
    tree_mask = torch.randint(
        -(2**31), 2**31 - 1, (m + 1, num_words), generator=gen, dtype=torch.int64
    ).to(torch.int32)  # garbage in the spare rows
    row_parents = []
    for r, (n, _) in enumerate(rows):
        row_parents.append(random_parents(n, gen, tree_kinds[r % len(tree_kinds)]))
        tree_mask[mask_row_start[r] : mask_row_start[r] + n] = pack_masks(
            row_parents[-1], num_words
        )

    # Paged KV: random block assignment.
    need = [-(-(c + n) // page) for n, c in rows]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.randint(
        0, num_blocks, (len(rows), max_blocks), generator=gen, dtype=torch.int64
    )
    used = 0
    for r, k in enumerate(need):
        block_table[r, :k] = perm[used : used + k]
        used += k

    def dev(x: torch.Tensor, dt: torch.dtype | None = None) -> torch.Tensor:
        # ``Tensor.to`` keeps the strides of dense non-contiguous views.
        return x.to(device=device, dtype=dt if dt is not None else x.dtype)

    if fa_layout:
        kv = torch.randn(num_blocks, page, num_kv_heads, 2 * head_dim, generator=gen)
        kv = dev(kv.transpose(1, 2), dtype)  # logical (blocks, Hkv, page, 2D)
        key_cache, value_cache = kv.transpose(1, 2).split(head_dim, dim=-1)
    else:
        shape = (num_blocks, page, num_kv_heads, head_dim)
        key_cache = dev(torch.randn(shape, generator=gen), dtype)
        value_cache = dev(torch.randn(shape, generator=gen), dtype)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)

    i32 = torch.int32
    return TreeBatch(
        query=dev(query, dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=dev(block_table, i32),
        q_start=dev(torch.tensor(q_start), i32),
        num_nodes=dev(torch.tensor([n for n, _ in rows]), i32),
        ctx_len=dev(torch.tensor([c for _, c in rows]), i32),
        mask_row_start=dev(torch.tensor(mask_row_start), i32),
        tree_mask=dev(tree_mask),
        max_nodes=max_nodes,
        scale=1.0 / math.sqrt(head_dim),
        tree_tokens=tree_tokens,
        parents=row_parents,
    )


def check_against_reference(
    batch: TreeBatch, attn_fn, *, return_lse: bool = False, **kwargs
) -> dict:
    """Run ``attn_fn`` and the reference; return error metrics."""
    out = batch.poisoned_out()
    lse = attn_fn(*batch.args(out), return_lse, **kwargs)
    ref = batch.poisoned_out()
    ref_lse = tree_attention_reference(*batch.args(ref), return_lse)
    res = compare_tree_rows(batch, out, ref)
    if return_lse:
        res["lse_err"] = lse_error(batch, lse, ref_lse)
    return res


def compare_tree_rows(batch: TreeBatch, out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Error of ``out`` against ``ref`` over the batch's tree tokens, and
    whether every other token of ``out`` was left alone (still NaN)."""
    idx = torch.tensor(batch.tree_tokens, dtype=torch.long, device=out.device)
    untouched = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    untouched[idx] = False
    o, r = out[idx].double(), ref[idx].double()
    return {
        "finite": bool(torch.isfinite(o).all()),
        "untouched_nan": bool(torch.isnan(out[untouched]).all()),
        "rel_err": float((o - r).norm() / r.norm().clamp_min(1e-30)),
        "tol": TOL[batch.query.dtype],
    }


def lse_error(batch: TreeBatch, lse: torch.Tensor, ref_lse: torch.Tensor) -> float:
    """Largest LSE difference over the batch's tree tokens."""
    idx = batch.tree_tokens
    return float((lse[idx].double() - ref_lse[idx].double()).abs().max())


# ---------------------------------------------------------------------------
# in-process tests (reference, helpers, heuristics; no Triton launch)
# ---------------------------------------------------------------------------


def test_pack_unpack_roundtrip():
    gen = torch.Generator().manual_seed(1)
    parents = random_parents(70, gen)
    words = pack_masks(parents, 3)
    dense = unpack_tree_mask(words, 70)
    for i in range(len(parents)):
        expect = torch.zeros(70, dtype=torch.bool)
        j = i
        while j >= 0:
            expect[j] = True
            j = parents[j]
        assert torch.equal(dense[i], expect), i
    assert (dense.diagonal()).all()


def test_reference_chain_matches_causal_sdpa():
    """A chain tree is causal attention over context + chain."""
    rows = [(5, 0), (9, 37), (3, 16)]
    b = make_batch(
        rows,
        page=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float64,
        tree_kinds=("chain",),
    )
    out = b.poisoned_out()
    lse = tree_attention_reference(*b.args(out), True)
    for r, (n, c) in enumerate(rows):
        pos = torch.arange(c + n)
        blocks = b.block_table[r, pos // 16].long()
        k = b.key_cache[blocks, pos % 16].repeat_interleave(2, 1).transpose(0, 1)
        v = b.value_cache[blocks, pos % 16].repeat_interleave(2, 1).transpose(0, 1)
        qs = int(b.q_start[r])
        q = b.query[qs : qs + n].transpose(0, 1)
        mask = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        exp = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=b.scale
        )
        torch.testing.assert_close(out[qs : qs + n], exp.transpose(0, 1))
        s = (q @ k.transpose(1, 2)) * b.scale
        exp_lse = s.masked_fill(~mask, float("-inf")).logsumexp(-1)
        torch.testing.assert_close(lse[qs : qs + n], exp_lse.transpose(0, 1).float())
    untouched = sorted(set(range(out.shape[0])) - set(b.tree_tokens))
    assert torch.isnan(out[untouched]).all()


def test_split_heuristic():
    from vllm_ddtree.v1.attention.ops.triton_tree_attention import choose_num_splits

    assert choose_num_splits(1000, 32768, 132, 64) == 1  # grid already full
    assert choose_num_splits(8, 250, 132, 64) == 1  # short context
    assert choose_num_splits(8, 32768, 132, 64) == 33  # one wave, 2 per SM
    assert choose_num_splits(32, 16384, 132, 64) == 8
    assert choose_num_splits(16, 32768, 132, 64, block_m=128) == 8  # 1 per SM
    assert choose_num_splits(8, 1024, 132, 64) == 8  # >= 128 positions a split
    # The B = 64 engine step at batch 1 (65 nodes x 4 q heads in 64-row tiles,
    # 8 kv heads): one wave of 2 programs per SM.
    assert choose_num_splits(40, 1024, 132, 64, block_m=64) == 6


def test_tile_heuristic():
    """Query tiles of at most 64 rows up to 512 rows (H200 sweep), wide
    tiles for bigger trees."""
    from vllm_ddtree.v1.attention.ops.triton_tree_attention import _pick_tiles

    assert [_pick_tiles(r, 128)[0] for r in (4, 17, 33, 68, 260, 512)] == [
        16, 32, 64, 64, 64, 64,
    ]  # fmt: skip
    assert _pick_tiles(513, 128)[0] == 256
    assert _pick_tiles(260, 128, block_m=128)[:3] == (128, 128, 8)


# ---------------------------------------------------------------------------
# Triton kernel under the interpreter (subprocess)
# ---------------------------------------------------------------------------

# name -> (rows, page, Hq, Hkv, D, dtype, fa_layout, kwargs)
CASES: dict[str, tuple] = {
    "fp32_d32_p16_g2": (
        [(1, 0), (5, 17), (12, 40), (3, 0)],
        16, 4, 2, 32, "float32", True, {"return_lse": True},
    ),
    "fp32_d48_p16_contig": (
        [(6, 23), (2, 0)], 16, 2, 1, 48, "float32", False, {},
    ),
    "fp16_d64_p32_split3": (
        [(7, 300), (33, 5), (1, 130), (4, 0)],
        32, 4, 2, 64, "float16", True, {"num_splits": 3, "return_lse": True},
    ),
    "bf16_d64_p16_g4_tiles": (
        [(40, 0), (17, 130), (2, 65)],
        16, 8, 2, 64, "bfloat16", True, {},
    ),
    "bf16_d32_p32_big_tree_split2": (
        [(257, 20), (1, 70)],
        32, 2, 2, 32, "bfloat16", False, {"num_splits": 2, "return_lse": True},
    ),
    # 12 q heads: two reduce programs per node, the second half masked.
    "fp32_d32_p16_h12_split4": (
        [(5, 200), (2, 70)],
        16, 12, 4, 32, "float32", True, {"num_splits": 4, "return_lse": True},
    ),
    "fp16_d32_p16_maxnodes_slack": (
        [(3, 64), (64, 63)], 16, 2, 2, 32, "float16", True, {"extra": 5},
    ),
    # Key tiles of 32 (head dim 256) and of 128 (forced 128-row query
    # tiles): the mask words a tile spans, 2 and 5 of them.
    "bf16_d256_p16_keys32": (
        [(5, 40), (37, 3)], 16, 2, 1, 256, "bfloat16", True, {},
    ),
    "fp16_d32_p16_keys128": (
        [(70, 150), (3, 20)], 16, 2, 1, 32, "float16", True, {"block_m": 128},
    ),
}  # fmt: skip


def _worker() -> None:
    try:
        import triton  # noqa: F401

        from vllm_ddtree.v1.attention.ops import triton_tree_attention as tta
    except Exception as exc:  # pragma: no cover - environment dependent
        print("SKIP " + json.dumps(f"cannot import triton kernel: {exc!r}"))
        return
    # Small contexts: let the forced splits really cut the context.
    tta._MIN_CHUNK = 64
    for name, (rows, page, hq, hkv, d, dt, fa, kw) in CASES.items():
        kw = dict(kw)
        extra = kw.pop("extra", 0)
        batch = make_batch(
            rows,
            page=page,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            dtype=getattr(torch, dt),
            seed=zlib.crc32(name.encode()) % 1000,
            fa_layout=fa,
            extra_max_nodes=extra,
        )
        try:
            res = check_against_reference(batch, tta.tree_attention, **kw)
        except Exception as exc:
            res = {"error": repr(exc)}
        print_case(name, res)
    for cases, check, fn in (
        (TREE_ONLY_CASES, _check_tree_only, tta.tree_attention),
        (SEEDED_CASES, _check_seeded, tta.tree_attention),
        (LAYER_CASES, check_layers, tta.TreePass),
    ):
        for name, dtype in cases.items():
            try:
                res = check(fn, getattr(torch, dtype))
            except Exception as exc:
                res = {"error": repr(exc)}
            print_case(name, res)


# Tree-only pass (the context is left to another kernel): rows' contexts are
# whole pages, so the reference can see the same tree with the context cut
# off by shifting each row's block table.
TREE_ONLY_CASES = {"tree-only-fp32": "float32", "tree-only-bf16": "bfloat16"}
TREE_ONLY_ROWS = [(9, 32), (33, 16), (1, 48), (17, 0)]


def _check_tree_only(
    attn_fn, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict:
    page = 16
    batch = make_batch(
        TREE_ONLY_ROWS, page=page, num_q_heads=4, num_kv_heads=2, head_dim=32,
        dtype=dtype, device=device, seed=7,
    )  # fmt: skip
    shifted = torch.zeros_like(batch.block_table)
    for r, (_, ctx) in enumerate(TREE_ONLY_ROWS):
        rest = batch.block_table[r, ctx // page :]
        shifted[r, : rest.numel()] = rest
    cut = TreeBatch(
        **{
            **batch.__dict__,
            "block_table": shifted,
            "ctx_len": torch.zeros_like(batch.ctx_len),
        }
    )
    out = batch.poisoned_out()
    lse = attn_fn(*batch.args(out), True, max_ctx_len=48, tree_only=True)
    ref = batch.poisoned_out()
    ref_lse = tree_attention_reference(*cut.args(ref), True)
    return {
        **compare_tree_rows(batch, out, ref),
        "lse_err": lse_error(batch, lse, ref_lse),
    }


# Tree pass folded into a context pass's output (``context_lse``): the
# context pass is the reference with every tree bit cleared, given in
# FlashAttention's form (LSE ``[Hq, T]``, +inf where a row has no context,
# whose output rows are then left poisoned: they must not be read).
SEEDED_CASES = {"seeded-fp32": "float32", "seeded-bf16": "bfloat16"}
SEEDED_ROWS = [(9, 32), (33, 20), (1, 48), (17, 0), (65, 5)]


def _check_seeded(
    attn_fn, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict:
    batch = make_batch(
        SEEDED_ROWS, page=16, num_q_heads=4, num_kv_heads=2, head_dim=32,
        dtype=dtype, device=device, seed=11,
    )  # fmt: skip
    no_tree = TreeBatch(
        **{**batch.__dict__, "tree_mask": torch.zeros_like(batch.tree_mask)}
    )
    out = batch.poisoned_out()
    ctx_lse = tree_attention_reference(*no_tree.args(out), True)
    ctx_lse = ctx_lse.T.contiguous().nan_to_num(nan=float("inf"), neginf=float("inf"))
    attn_fn(*batch.args(out), context_lse=ctx_lse)
    ref = batch.poisoned_out()
    tree_attention_reference(*batch.args(ref))
    return compare_tree_rows(batch, out, ref)


# One tree pass over the layers of a step (``TreePass``): the same trees and
# block table, each layer with caches and queries of its own (the same
# shapes, strides and storage offsets, fresh storage), and a last layer whose
# query sits off the 16-byte alignment the first had (another variant of the
# kernel). Splits forced: the layers share the pass's split scratch.
LAYER_CASES = {"layers-bf16": "bfloat16", "layers-fp32": "float32"}
LAYER_ROWS = [(9, 100), (33, 20), (1, 48), (17, 0), (65, 130)]


def other_layer(batch: TreeBatch, seed: int, misalign_query: bool = False):
    """``batch`` with fresh random queries and caches laid out like its own."""
    gen = torch.Generator().manual_seed(seed)

    def like(x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        numel = x.untyped_storage().nbytes() // x.element_size() + shift
        storage = torch.randn(numel, generator=gen).to(x.device, x.dtype)
        return storage.as_strided(x.shape, x.stride(), x.storage_offset() + shift)

    return TreeBatch(
        **{
            **batch.__dict__,
            "query": like(batch.query, shift=1 if misalign_query else 0),
            "key_cache": like(batch.key_cache),
            "value_cache": like(batch.value_cache),
        }
    )


def check_layers(
    pass_cls, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> dict:
    """Every layer's output of one ``pass_cls`` (:class:`TreePass`) against
    the reference, the worst layer's errors; ``variants``: the compiled
    variants the pass launches directly (none under the interpreter)."""
    batch = make_batch(
        LAYER_ROWS, page=16, num_q_heads=4, num_kv_heads=2, head_dim=32,
        dtype=dtype, device=device, seed=5,
    )  # fmt: skip
    layers = [batch, other_layer(batch, 1), other_layer(batch, 2)]
    layers.append(other_layer(batch, 3, misalign_query=True))
    outs = [b.poisoned_out() for b in layers]
    tree_pass = pass_cls(*batch.args(outs[0]), num_splits=3)
    for b, out in zip(layers, outs, strict=True):
        tree_pass(b.query, b.key_cache, b.value_cache, out)
    results = []
    for b, out in zip(layers, outs, strict=True):
        ref = b.poisoned_out()
        tree_attention_reference(*b.args(ref))
        results.append(compare_tree_rows(b, out, ref))
    return {
        **max(results, key=lambda res: res["rel_err"]),
        "finite": all(res["finite"] for res in results),
        "untouched_nan": all(res["untouched_nan"] for res in results),
        "variants": len(tree_pass.fwd.runners),
    }


interp_results = interpreter_fixture(__file__, timeout=600)


@pytest.mark.parametrize(
    "name", [*CASES, *TREE_ONLY_CASES, *SEEDED_CASES, *LAYER_CASES]
)
def test_triton_kernel_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert rec["finite"], rec
    assert rec["untouched_nan"], rec
    assert rec["rel_err"] < rec["tol"], rec
    if "lse_err" in rec:
        assert rec["lse_err"] < 1e-2, rec


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
