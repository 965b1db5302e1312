# SPDX-License-Identifier: Apache-2.0
"""The greedy-comparison rule of the engine tests: outputs may part only at
a near-tie of the reference (``vllm_ddtree.greedy_ties``). A rule that
let every divergence through would make those tests unable to fail."""

from __future__ import annotations

from vllm_ddtree.greedy_ties import TIE, diverges_off_tie


def test_divergence_off_a_tie_is_reported():
    assert diverges_off_tie([1, 2, 3], [1.0, 1.0, 1.0], [1, 5, 3], TIE) == 1


def test_divergence_at_a_tie_is_allowed():
    assert diverges_off_tie([1, 2, 3], [1.0, 0.0, 1.0], [1, 5, 7], TIE) is None


def test_equal_outputs_agree():
    assert diverges_off_tie([1, 2, 3], [1.0, 1.0, 1.0], [1, 2, 3], TIE) is None


def test_a_shorter_output_diverges_where_it_ends():
    assert diverges_off_tie([1, 2, 3], [1.0, 1.0, 1.0], [1, 2], TIE) == 2
