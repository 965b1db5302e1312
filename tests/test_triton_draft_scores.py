# SPDX-License-Identifier: Apache-2.0
"""The drafter's one-pass log-normaliser and the top-k built on it equal
torch's log-softmax top-k (CPU, Triton interpreted, in one subprocess like
the other kernel tests)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.utils import interpreted_case, interpreter_fixture, run_case

# name -> (rows, vocab, padded row length, dtype, k, seed)
CASES: dict[str, tuple[int, int, int, torch.dtype, int, int]] = {
    # Several blocks of the row loop, the last one partial.
    "bf16-multi-block": (5, 9000, 9000, torch.bfloat16, 64, 0),
    # vLLM's logits are a view cut from a padded vocabulary.
    "fp32-padded-view": (3, 700, 768, torch.float32, 16, 1),
    "fp16-small-vocab": (4, 50, 64, torch.float16, 8, 2),
}


def _run(rows: int, vocab: int, padded: int, dtype, k: int, seed: int) -> dict:
    from vllm_ddtree.v1.ops.triton_draft_scores import (
        draft_topk_triton,
        row_logsumexp_triton,
    )

    g = torch.Generator().manual_seed(seed)
    full = (4 * torch.randn(rows, padded, generator=g)).to(dtype)
    logits = full[:, :vocab]
    # Masked tokens (-inf), and a row masked everywhere but one token.
    logits[0, :: max(vocab // 7, 1)] = float("-inf")
    logits[1, 1:] = float("-inf")
    want_lse = torch.logsumexp(logits.float(), dim=-1)
    got_lse = row_logsumexp_triton(logits)
    want_values, want_tokens = logits.float().log_softmax(dim=-1).topk(k, dim=-1)
    got_values, got_tokens = draft_topk_triton(logits, k)
    picked = logits.float().log_softmax(dim=-1).gather(1, got_tokens)
    # Row 1 has a single finite logit: its other top-k entries are -inf.
    finite = [0, *range(2, rows)]
    return {
        "lse_error": float((got_lse - want_lse).abs().max()),
        "values_error": float((got_values - want_values)[finite].abs().max()),
        # Ties aside, the same tokens, each with its own log-probability.
        "values_are_logprobs": float((picked - got_values)[finite].abs().max()),
        "row_masked_lse": float(got_lse[1]),
        "row_masked_want": float(want_lse[1]),
        "values_dtype": str(got_values.dtype),
        "sorted": bool((got_values[:, :-1] >= got_values[:, 1:]).all()),
    }


def _all_masked() -> dict:
    from vllm_ddtree.v1.ops.triton_draft_scores import row_logsumexp_triton

    logits = torch.full((2, 100), float("-inf"), dtype=torch.bfloat16)
    logits[1, 3] = 2.0
    return {"lse": row_logsumexp_triton(logits).tolist()}


def _worker() -> None:
    for name, case in CASES.items():
        run_case(name, lambda case=case: _run(*case))
    run_case("all-masked", _all_masked)


interp_results = interpreter_fixture(__file__, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_draft_topk_equals_log_softmax_topk_interpreted(interp_results, name):
    rec = interpreted_case(interp_results, name)
    assert rec["lse_error"] < 1e-4, rec
    assert rec["values_error"] < 1e-4 and rec["values_are_logprobs"] < 1e-4, rec
    assert rec["row_masked_lse"] == pytest.approx(rec["row_masked_want"]), rec
    assert rec["values_dtype"] == "torch.float32" and rec["sorted"], rec


def test_row_logsumexp_of_masked_rows_interpreted(interp_results):
    rec = interpreted_case(interp_results, "all-masked")
    assert rec["lse"] == [float("-inf"), 2.0], rec


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
