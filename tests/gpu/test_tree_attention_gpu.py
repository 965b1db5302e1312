"""GPU tests of the Triton tree-attention kernel against the float64 reference.

Grid: trees of 1..257 nodes, contexts 0..4096, block sizes 16/32/64,
bf16/fp16 (plus one fp32 case), GQA and plain heads, head dims 64/128/256,
batches of mixed rows interleaved with untouched tokens, forced and heuristic
split-KV, LSE output, and CUDA-graph capture/replay.

Run on a GPU machine: ``python -m pytest tests/gpu/test_tree_attention_gpu.py -q``
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_HELPERS_PATH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "test_triton_tree_attention.py",
)
_spec = importlib.util.spec_from_file_location("_tree_attn_helpers", _HELPERS_PATH)
H = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = H  # dataclasses look their module up there
_spec.loader.exec_module(H)


def _kernel():
    from vllm_ddtree.v1.attention.ops.triton_tree_attention import tree_attention

    return tree_attention


def _assert_ok(res: dict, what: str) -> None:
    assert res["finite"], (what, res)
    assert res["untouched_nan"], (what, res)
    assert res["rel_err"] < res["tol"], (what, res)
    if "lse_err" in res:
        assert res["lse_err"] < 2e-3, (what, res)


DTYPES = [torch.bfloat16, torch.float16]
PAGES = [16, 32, 64]
HEADS = [(32, 8, 128), (8, 8, 64), (16, 2, 256)]  # (Hq, Hkv, D)
TREE_SIZES = [1, 2, 16, 33, 64, 129, 256, 257]
CONTEXTS = [0, 1, 100, 1024, 4096]


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}_d{h[2]}")
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grid(dtype, page, heads, num_splits):
    """Every (tree size, context) pair, as the rows of one batch."""
    hq, hkv, d = heads
    rows = [(n, c) for n in TREE_SIZES for c in CONTEXTS]
    b = H.make_batch(
        rows,
        page=page,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
        device="cuda",
        seed=page * 13 + d + (num_splits or 0),
    )
    res = H.check_against_reference(
        b, _kernel(), return_lse=True, num_splits=num_splits
    )
    _assert_ok(res, "grid")


@pytest.mark.parametrize("n", [1, 16, 64, 257])
@pytest.mark.parametrize("ctx", [0, 100, 4096])
def test_batch_of_one(n, ctx):
    """Batch of one with the split heuristic (GPU-sized ``num_splits``)."""
    b = H.make_batch(
        [(n, ctx)],
        page=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        seed=n * 7919 + ctx,
    )
    res = H.check_against_reference(b, _kernel(), return_lse=True, max_ctx_len=ctx)
    _assert_ok(res, f"n={n} ctx={ctx}")


@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_batch(dtype, page, num_splits):
    """24 mixed rows (random sizes, some empty contexts), Qwen3-8B heads."""
    rng = random.Random(page * 31 + (num_splits or 0))
    rows = []
    for i in range(24):
        n = rng.choice([1, 2, rng.randint(1, 257)])
        c = 0 if i % 6 == 0 else rng.randint(1, 4096)
        rows.append((n, c))
    b = H.make_batch(
        rows,
        page=page,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=dtype,
        device="cuda",
        seed=page + 1000 * (num_splits or 0),
        extra_max_nodes=3,
    )
    res = H.check_against_reference(
        b, _kernel(), return_lse=True, num_splits=num_splits
    )
    _assert_ok(res, f"rows={rows}")


@pytest.mark.parametrize("fa_layout", [True, False])
def test_fp32_and_layouts(fa_layout):
    b = H.make_batch(
        [(5, 3000), (64, 0), (200, 777)],
        page=32,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device="cuda",
        fa_layout=fa_layout,
    )
    _assert_ok(H.check_against_reference(b, _kernel(), return_lse=True), "fp32")


def test_long_context_batch_one():
    """Batch 1 with a long context: the split-KV heuristic must kick in."""
    from vllm_ddtree.v1.attention.ops import triton_tree_attention as tta

    b = H.make_batch(
        [(16, 32768)],
        page=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert tta.choose_num_splits(8, 32768, sms, 64, 64) > 1
    res = H.check_against_reference(b, tta.tree_attention, return_lse=True)
    _assert_ok(res, "long")


def test_cuda_graph_replay():
    """Capture once, then change context lengths and data in place, replay."""
    fn = _kernel()
    b = H.make_batch(
        [(16, 2000), (5, 10), (64, 3000)],
        page=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    out = b.poisoned_out()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*b.args(out), False, max_ctx_len=4096)  # warm-up / compile
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*b.args(out), False, max_ctx_len=4096)
    b.ctx_len.copy_(torch.tensor([1500, 0, 2900], dtype=torch.int32))
    b.query.normal_()
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = b.poisoned_out()
    H.tree_attention_reference(*b.args(ref))
    idx = torch.tensor(b.tree_tokens, device="cuda")
    o, r = out[idx].double(), ref[idx].double()
    assert float((o - r).norm() / r.norm()) < H.TOL[torch.bfloat16]


@pytest.mark.parametrize("num_nodes", [9, 65])
def test_uniform_tree_buffers_under_cuda_graph(num_nodes):
    """The full-graph path of uniform batches: capture with the buffers'
    chain masks (as vLLM's capture does), then let the builder's ``fill``
    write real trees and contexts into the same buffers, replay, compare."""
    from vllm_ddtree.v1.attention.backends.tree_attn import (
        TreeAttentionInfo,
        UniformTreeBuffers,
    )

    n, ctx = num_nodes, [700, 0, 2100]
    b = H.make_batch(
        [(n, c) for c in ctx], page=16, num_q_heads=32, num_kv_heads=8,
        head_dim=128, dtype=torch.bfloat16, device="cuda", seed=5, interleave=False,
    )  # fmt: skip
    buffers = UniformTreeBuffers(4, n, 4096, torch.device("cuda"))
    seq_lens = torch.tensor([c + n for c in ctx] + [0], device="cuda").int()
    # One padding row, as in a replay of a graph captured for 4 requests.
    table = torch.cat([b.block_table, torch.zeros_like(b.block_table[:1])])
    query = torch.cat([b.query, torch.zeros_like(b.query[:n])])
    out = torch.full_like(query, float("nan"))

    def run(info: TreeAttentionInfo) -> None:
        packed, starts = info.packed_mask
        _kernel()(
            query, b.key_cache, b.value_cache, out, table, info.q_start,
            info.num_nodes, info.ctx_len, starts, packed, b.scale, n,
            max_ctx_len=info.max_ctx_len,
        )  # fmt: skip

    chain = buffers.fill(4, seq_lens, None)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(chain)  # warm-up / compile
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(chain)
    # As the runner publishes them: parents only (``fill`` packs the masks
    # into the buffers; the reference reads the batch's own packing).
    published = TreeAttentionInfo(
        req_rows=b.q_start, q_start=b.q_start, num_nodes=b.num_nodes,
        ctx_len=b.ctx_len, parents=torch.tensor(b.parents, device="cuda"),
        max_depth=n - 1, req_rows_cpu=[0, 1, 2], q_start_cpu=[0, n, 2 * n],
        num_nodes_cpu=[n] * 3, ctx_len_cpu=ctx, covers_batch=True,
    )  # fmt: skip
    buffers.fill(4, seq_lens, published)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = b.poisoned_out()
    H.tree_attention_reference(*b.args(ref))
    o, r = out[: 3 * n].double(), ref.double()
    assert float((o - r).norm() / r.norm()) < H.TOL[torch.bfloat16]
    assert torch.isfinite(out[3 * n :]).all()  # the padding row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_only_pass(dtype):
    """The tree-only pass equals the reference with the context cut off."""
    res = H._check_tree_only(_kernel(), dtype, "cuda")
    assert res["finite"] and res["untouched_nan"], res
    assert res["rel_err"] < res["tol"], res
    assert res["lse_err"] < 1e-2, res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_pass_continues_context_state(dtype):
    """``context_lse``: the tree pass folded into a given context pass."""
    res = H._check_seeded(_kernel(), dtype, "cuda")
    assert res["finite"] and res["untouched_nan"], res
    assert res["rel_err"] < res["tol"], res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_pass_over_layers(dtype):
    """One ``TreePass`` run layer after layer (its split scratch shared, the
    compiled kernel launched directly from the second layer on) equals the
    reference in every layer, a layer whose query is laid out at another
    alignment included: that one gets a compiled variant of its own."""
    from vllm_ddtree.v1.attention.ops.triton_tree_attention import TreePass

    res = H.check_layers(TreePass, dtype, "cuda")
    assert res["finite"] and res["untouched_nan"], res
    assert res["rel_err"] < res["tol"], res
    assert res["variants"] == 2, res


def test_flash_context_plus_tree_pass():
    """FlashAttention over the context + our tree pass continuing its softmax
    state (``context_lse``) equals the fused kernel."""
    pytest.importorskip("vllm.vllm_flash_attn")
    from vllm_ddtree.v1.attention.ops.flash_context_tree_attention import (
        flash_context_tree_attention,
    )

    rows = [(65, 1000), (17, 4096), (1, 37), (33, 16)]  # a root always has context
    b = H.make_batch(
        rows, page=16, num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, device="cuda", seed=3, interleave=False,
    )  # fmt: skip
    fused = b.poisoned_out()
    _kernel()(*b.args(fused))
    merged = b.poisoned_out()
    ends = torch.cumsum(b.num_nodes, 0, dtype=torch.int32)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), ends])
    flash_context_tree_attention(*b.args(merged), cu_seqlens_q=cu_q, max_ctx_len=4096)
    err = (merged.float() - fused.float()).norm() / fused.float().norm()
    assert err < 1e-2
