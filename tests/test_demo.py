# SPDX-License-Identifier: Apache-2.0
"""The demo's greedy comparison with no-spec (``--compare``), without
engines: equal outputs, a divergence at a near-tie, and one off a tie."""

from __future__ import annotations

import pytest

from vllm_ddtree import demo


def _result(token_ids, gaps=None) -> demo.RunResult:
    return demo.RunResult(texts=[], token_ids=token_ids, seconds=1.0, gaps=gaps)


@pytest.mark.parametrize(
    ("tree_tokens", "gap", "verdict"),
    [
        ([[1, 2, 3], [4, 5, 6]], 0.0, "yes"),
        ([[1, 2, 3], [4, 9, 9]], 0.02, "up to a bf16 near-tie (prompt 1, token 1"),
        ([[1, 2, 3], [4, 9, 9]], 0.5, "NO (prompt 1, token 1"),
    ],
)
def test_agreement(monkeypatch, tree_tokens, gap, verdict):
    plain_tokens = [[1, 2, 3], [4, 5, 6]]
    reruns = []

    def rerun(args, prompts, speculative_config, gaps=False):
        reruns.append(gaps)
        return _result(plain_tokens, [[1.0, 1.0, 1.0], [1.0, gap, 1.0]])

    monkeypatch.setattr(demo, "_run", rerun)
    got = demo._agreement(None, [], _result(plain_tokens), _result(tree_tokens))
    assert got.startswith(verdict), got
    # Log-probabilities only when the outputs differ, from a no-spec run.
    assert reruns == ([] if verdict == "yes" else [True])
