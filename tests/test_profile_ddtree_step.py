# SPDX-License-Identifier: Apache-2.0
"""The step profiler's per-function timers (benchmarks/profile_ddtree_step.py),
no engine: every entry names a function of this vLLM and of the plugin (a
renamed one would silently drop out of the profile), and the timers come
off again; its speculative config follows the e2e benchmark's."""

from __future__ import annotations

import time
from types import SimpleNamespace

from benchmarks.profile_ddtree_step import (
    FUNCTIONS,
    Step,
    _patch_functions,
    _unpatch,
    speculative_config,
    step_times,
    time_phases,
    triton_compiles,
)
from vllm_ddtree.v1.attention.backends.tree_attn import UniformTreeBuffers
from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree import rejection_sampler


def test_every_timed_function_resolves_and_is_restored():
    fill = UniformTreeBuffers.fill
    walk = rejection_sampler.walk_trees_triton
    wrapped: list[str] = []

    def timed_by_label(label, fn):
        wrapped.append(label)
        return lambda *args, **kwargs: fn(*args, **kwargs)

    patched = _patch_functions(timed_by_label)
    try:
        assert len(patched) == len(FUNCTIONS)
        assert wrapped == [entry.partition(":")[2] for entry in FUNCTIONS]
        assert UniformTreeBuffers.fill is not fill
    finally:
        _unpatch(patched)
    assert UniformTreeBuffers.fill is fill
    assert rejection_sampler.walk_trees_triton is walk
    assert "__call__" in vars(rejection_sampler.TreeWalkSampler)


def test_an_inherited_method_is_timed_on_the_subclass_and_removed(monkeypatch):
    from benchmarks import profile_ddtree_step
    from vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator import (
        DDTreeSpeculator,
    )

    entry = (
        "vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator:"
        "DDTreeSpeculator._run_model"
    )
    monkeypatch.setattr(profile_ddtree_step, "FUNCTIONS", (entry,))
    assert "_run_model" not in vars(DDTreeSpeculator)
    patched = _patch_functions(lambda label, fn: lambda *a, **k: fn(*a, **k))
    assert "_run_model" in vars(DDTreeSpeculator)
    _unpatch(patched)
    assert "_run_model" not in vars(DDTreeSpeculator)


def test_step_times_split_mixed_and_decode_steps():
    """A step's time runs to the next step's start; mixed steps (a prefill
    beside the decodes) and decode-only ones get medians and means of their
    own; the slowest steps are listed, longest first, with the kernels
    compiled in them."""
    starts = [0.0, 0.003, 0.010, 0.013, 0.016, 0.024, 0.027]
    mixed = [False, True, False, False, True, False, False]
    steps = [Step(t, m) for t, m in zip(starts, mixed, strict=True)]
    times = step_times(steps)
    assert round(times["median_mixed_step_ms"], 6) == 7.5
    assert round(times["median_decode_step_ms"], 6) == 3.0
    assert round(times["median_step_ms"], 6) == 3.0
    assert round(times["mean_mixed_step_ms"], 6) == 7.5
    assert round(times["mean_step_ms"], 6) == 4.5
    assert times["mixed_step_share"] == 2 / 6
    # Kernels compiled during step 4 (one at its very start) and step 0.
    compiled = [(0.016, "walk"), (0.020, "lay_out"), (0.001, "build")]
    slowest = step_times(steps, compiled, num_slowest=2)
    assert [
        (s["step"], round(s["ms"], 6), s["mixed"], s["compiled"])
        for s in slowest["slowest_steps"]
    ] == [(4, 8.0, True, ["walk", "lay_out"]), (1, 7.0, True, [])]
    assert slowest["triton_compiles"] == 3


def test_triton_compiles_names_the_variant():
    """Each compile in the run is named by its kernel and compile-time
    arguments, as Triton's cache hook reports them (the kernel's own and
    the hook's previous value are back afterwards)."""
    from triton import knobs

    fn = SimpleNamespace(
        name="_prepare_inputs",
        jit_function=SimpleNamespace(arg_names=["x", "n", "BLOCK"]),
    )

    def run() -> None:
        knobs.runtime.jit_cache_hook(
            key="k", repr="r", fn=fn, compile={"constants": {(2,): 32, (1, 0): 7}}
        )

    previous = knobs.runtime.jit_cache_hook
    compiled = triton_compiles(run)
    assert [name for _, name in compiled] == ["_prepare_inputs(BLOCK=32)"]
    assert knobs.runtime.jit_cache_hook is previous


def test_phases_are_split_between_mixed_and_decode_steps(monkeypatch):
    """Each phase counts in the step the runner last executed: per step,
    and per mixed and per decode-only step apart; the wrappers come off."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    class Runner:
        def execute_model(self, scheduler_output):
            clock[0] += 0.004 if scheduler_output.scheduled_new_reqs else 0.001

        def sample_tokens(self, grammar_output):
            clock[0] += 0.0005

    runner = Runner()
    core = SimpleNamespace(
        scheduler=None,
        model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))
        ),
    )
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=core))
    )

    def run() -> None:
        for new in ([], ["prompt"], []):
            runner.execute_model(SimpleNamespace(scheduled_new_reqs=new))
            runner.sample_tokens(None)

    phases = time_phases(llm, run, steps=3)
    assert set(phases) == {"runner.execute_model", "runner.sample_tokens"}
    rounded = {
        label: {k: round(v, 6) for k, v in row.items()} for label, row in phases.items()
    }
    assert rounded["runner.execute_model"] == {
        "ms_per_step": 2.0,
        "calls": 3,
        "ms_per_mixed_step": 4.0,
        "ms_per_decode_step": 1.0,
    }
    assert rounded["runner.sample_tokens"] == {
        "ms_per_step": 0.5,
        "calls": 3,
        "ms_per_mixed_step": 0.5,
        "ms_per_decode_step": 0.5,
    }
    assert "execute_model" not in vars(runner)


def test_schedule_sizes_ddtree_trees_only():
    """``--schedule`` reaches a DDTree engine as vLLM's batch-size schedule
    (the e2e benchmark's rows' trees), ``--chain-from`` as its chain steps;
    DFlash's chains and no-spec ignore both."""
    from benchmarks.bench_e2e import parse_schedule

    schedule = parse_schedule("1-8:64,9-32:32,33-1024:16")

    def config(method: str, schedule=schedule, chain_from=None):
        args = SimpleNamespace(
            method=method,
            drafter="d",
            budget=64,
            runner="v2",
            schedule=schedule,
            chain_from=chain_from,
        )
        return speculative_config(args)

    chains = config("ddtree", chain_from=9)["ddtree"]
    assert chains["chain_from_batch_size"] == 9
    assert "chain_from_batch_size" not in config("dflash", chain_from=9)

    spec = config("ddtree")
    assert spec["num_speculative_tokens"] == 64
    assert spec["num_speculative_tokens_per_batch_size"] == [
        [1, 8, 64],
        [9, 32, 32],
        [33, 1024, 16],
    ]
    assert spec["ddtree"] == {"adaptive_budget": False, "model_runner": "v2"}
    assert "num_speculative_tokens_per_batch_size" not in config("ddtree", None)
    assert "num_speculative_tokens_per_batch_size" not in config("dflash")
    assert config("nospec") is None
