# SPDX-License-Identifier: Apache-2.0
"""The tree-attention benchmark's bookkeeping (benchmarks/bench_tree_attention.py),
no GPU: the tree's FLOP count, the roofline and which bound sets it, the
better of the two designs and the markdown table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_tree_attention import (
    _popcount,
    _random_masks,
    markdown_table,
    roofline_ms,
    summarize,
)


def test_popcount_counts_every_bit_of_int32_words():
    words = torch.tensor([0, 1, -1, -(2**31), 0x55555555, 7], dtype=torch.int32)
    expected = [bin(int(w) & 0xFFFFFFFF).count("1") for w in words]
    assert _popcount(words).tolist() == expected


def test_random_tree_masks_count_each_node_and_its_ancestors():
    # A node sees itself and its ancestors: its count is its parent's + 1,
    # and the root sees only itself. 40 nodes span two mask words.
    n = 40
    masks = _random_masks(2, n, torch.Generator().manual_seed(0))
    counts = _popcount(masks).sum(dim=1).view(2, n)
    assert counts[:, 0].tolist() == [1, 1]
    for tree in range(2):
        rows = masks.view(2, n, -1)[tree].long() & 0xFFFFFFFF
        for i in range(1, n):
            bits = [(int(rows[i, j // 32]) >> (j % 32)) & 1 for j in range(n)]
            parent = max(j for j in range(i) if bits[j])
            assert counts[tree, i] == counts[tree, parent] + 1


def test_roofline_is_the_slower_bound():
    args = SimpleNamespace(copy_bw=1e12, matmul_flops=1e15)
    assert roofline_ms(10**9, 2 * 10**12, args) == pytest.approx((2.0, "compute"))
    assert roofline_ms(3 * 10**9, 10**12, args) == pytest.approx((3.0, "memory"))


def test_summarize_picks_the_faster_design():
    rec = {"ours_ms": 2.0, "fa3_tree_ms": 1.0, "fa3_ms": 0.5, "roofline_ms": 0.5}
    out = summarize(rec)
    assert out["best"] == "fa3_tree"
    assert out["best_ms"] == 1.0
    assert out["best_vs_chain"] == pytest.approx(2.0)
    assert out["roofline_frac"] == pytest.approx(0.25)
    assert out["best_roofline_frac"] == pytest.approx(0.5)
    # Without FlashAttention the fused kernel is the only design.
    alone = summarize({"ours_ms": 2.0, "roofline_ms": 1.0})
    assert alone["best"] == "ours" and "best_vs_chain" not in alone


def test_markdown_table_rows_and_missing_cells():
    rows = [
        summarize(
            {
                "batch": 1,
                "ctx": 1024,
                "tree": 65,
                "ours_ms": 0.0174,
                "fa3_tree_ms": 0.0261,
                "fa3_ms": 0.0185,
                "roofline_ms": 0.0087,
                "bound": "compute",
            }
        ),
        {"batch": 8, "ctx": 4096, "tree": 16, "error": "OOM"},
    ]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| 1 | 1024 | 65 | 17.4 | 26.1 | 18.5 | 0.94 | - | compute | 50% | 50% |"
    )
    assert lines[3] == "| 8 | 4096 | 16 | - | - | - | - | - | - | - | - |"
