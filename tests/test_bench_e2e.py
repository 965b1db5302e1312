# SPDX-License-Identifier: Apache-2.0
"""The end-to-end benchmark's bookkeeping (benchmarks/bench_e2e.py), no
engine: acceptance histograms, ratios, the table, and how engine settings
are sized so that a grid split over several runs keeps one set of them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from benchmarks.bench_e2e import (
    DFLASH_DRAFTS,
    EngineWorker,
    _engine_settings,
    _enough,
    _jobs,
    _speculative_config,
    _tokens_needed,
    acceptance_histogram,
    add_ratios,
    batch_schedule,
    batch_schedules,
    combine_rounds,
    histogram_rows,
    main,
    merged_rows,
    output_digest,
    parse_schedule,
    process_tree_cpu_seconds,
    speedup_series,
    start_engines,
    table,
)
from vllm_ddtree.fixtures import TRAINED_TINY_DIR


def test_acceptance_histogram_counts_rounds_by_length():
    # 10 rounds; 5 accepted at least one draft, 3 at least two, 1 all three.
    hist = acceptance_histogram([5, 3, 1], drafts=10)
    assert hist == [5, 2, 2, 1]
    assert sum(hist) == 10


def _row(method, tok_s, budget=None, **extra):
    return {
        "method": method, "budget": budget, "batch": 1, "temperature": 0.0,
        "tok_s": tok_s, "tau": 3.0, "step_ms": 5.0, "adaptive_budget": True,
        **extra,
    }  # fmt: skip


def test_steady_rows_compare_with_steady_baselines():
    """Rows of steady runs (requests kept in flight) and of waves at the same
    batch and T are two measurements: each row's ratios use its own mode's
    baselines, and the table names steady rows."""
    rows = add_ratios(
        [
            _row("dflash", 100.0),
            _row("dflash", 200.0, steady=True),
            _row("ddtree", 150.0, 64),
            _row("ddtree", 300.0, 64, steady=True, async_scheduling=True),
        ]
    )
    assert [r["vs_dflash"] for r in rows] == [1.0, 1.0, 1.5, 1.5]
    methods = [line.split("|")[3].strip() for line in table(rows).splitlines()[2:]]
    assert methods == ["dflash", "ddtree", "dflash steady", "ddtree async steady"]


def test_enough_needs_both_requests_and_time():
    start = time.perf_counter()
    assert not _enough(4, 0.0, start)(3)
    assert _enough(4, 0.0, start)(4)
    assert not _enough(4, 3600.0, start)(100)


def test_ratios_and_table():
    reference = [output_digest([5, 6, 7]), output_digest([8, 9])]
    rows = add_ratios(
        [
            _row("nospec", 100.0, output_digests=reference),
            _row(
                "dflash",
                200.0,
                DFLASH_DRAFTS,
                nodes_per_draft=15.0,
                output_digests=[reference[0], output_digest([8, 10])],
            ),
            _row("ddtree", 300.0, 64, nodes_per_draft=37.5, output_digests=reference),
            # A row written before the draft-token counter and the outputs.
            _row("ddtree", 250.0, 16),
        ]
    )
    assert [r["vs_dflash"] for r in rows] == [0.5, 1.0, 1.5, 1.25]
    assert [r["vs_nospec"] for r in rows] == [1.0, 2.0, 3.0, 2.5]
    assert [r["same_as_nospec"] for r in rows] == [1.0, 0.5, 1.0, None]
    lines = table(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[4] == "nodes" and header[-1] == "= no-spec"
    cells = {
        (r[2], r[3]): (r[4], r[-1])
        for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    }
    assert cells == {
        ("nospec", "-"): ("-", "100%"),
        ("dflash", "-"): ("15.0", "50%"),
        ("ddtree", "64"): ("37.5", "100%"),
        ("ddtree", "16"): ("-", "-"),
    }


def test_rounds_pair_ratios_and_show_ranges():
    """Ratios pair the rows of one round (a drifting machine slows a whole
    round, not one method); a variant's rounds combine into their median
    with ranges, and a point timed once keeps its single-run cells."""
    dflash = [100.0, 50.0, 120.0]
    ddtree = [110.0, 60.0, 108.0]
    rows = [
        *(_row("dflash", t, round=k) for k, t in enumerate(dflash)),
        *(_row("ddtree", t, 64, round=k) for k, t in enumerate(ddtree)),
        _row("ddtree", 90.0, 16),
    ]
    combined = {(r["method"], r["budget"]): r for r in combine_rounds(add_ratios(rows))}
    tree = combined["ddtree", 64]
    # Per round 1.1, 1.2, 0.9; unpaired medians would say 108 / 100.
    assert tree["vs_dflash"] == pytest.approx(1.1)
    assert tree["vs_dflash_range"] == pytest.approx([0.9, 1.2])
    assert (tree["rounds"], tree["tok_s"], tree["tok_s_range"]) == (
        3,
        108.0,
        [60.0, 110.0],
    )
    assert "round" not in tree
    alone = combined["ddtree", 16]
    # Timed once, as round 0: against DFlash's round 0.
    assert (alone["rounds"], alone["vs_dflash"]) == (1, 0.9)
    cells = {
        (c[2], c[3]): (c[5], c[8])
        for c in (
            [x.strip() for x in line.strip("|").split("|")]
            for line in table(list(combined.values())).splitlines()[2:]
        )
    }
    assert cells == {
        ("dflash", "-"): ("100.0 (50.0-120.0)", "1.00"),
        ("ddtree", "64"): ("108.0 (60.0-110.0)", "1.10 (0.90-1.20)"),
        ("ddtree", "16"): ("90.0", "0.90"),
    }


def test_a_later_call_keeps_the_points_it_did_not_time():
    earlier = [
        _row("dflash", 1.0, batch=16, round=0),
        _row("dflash", 2.0, batch=16, round=1),
        _row("dflash", 3.0, batch=64),
    ]
    new = [_row("dflash", 4.0, batch=16)]
    # Batch 16's two old rounds go with it; batch 64 stays.
    assert [r["tok_s"] for r in merged_rows(earlier, new)] == [3.0, 4.0]


def test_engines_take_turns_in_rounds(tmp_path, capfd):
    """``--rounds 2``: both engines (tiny pair, CPU) alive at once, each
    timing every round, the second round led by the other engine."""
    out = tmp_path / "e2e"
    main(
        ["--out", str(out), "--methods", "dflash,ddtree", "--budgets", "8",
         "--batch-sizes", "1", "--temperatures", "0", "--max-tokens", "24",
         "--dtype", "float32",
         "--min-requests", "1", "--min-seconds", "0", "--rounds", "2",
         "--job-timeout", "400"]
    )  # fmt: skip
    log = capfd.readouterr().out
    order = [line.split()[1] for line in log.splitlines() if " round " in line]
    # Round 1 starts with the other engine.
    assert order == ["dflash", "ddtree", "ddtree", "dflash"]
    results = json.loads((out / "results.json").read_text())
    assert sorted(r["round"] for r in results["runs"]) == [0, 0, 1, 1]
    rows = {r["method"]: r for r in results["rows"]}
    assert rows["dflash"]["rounds"] == rows["ddtree"]["rounds"] == 2
    assert rows["ddtree"]["vs_dflash"] > 0
    # (In bfloat16 on CPU the tiny pair's drafts were never accepted.)
    assert rows["ddtree"]["tau"] > 1.0
    assert all(0 < r["host_ref_ms"] < 1e3 for r in results["runs"])
    # The engines' CPU time while each row ran (the engine core included).
    assert all(r["cpu_s"] > 0 for r in results["runs"])


def test_process_tree_cpu_time_counts_children():
    """A live child's CPU time counts (the engine core is one)."""
    before = process_tree_cpu_seconds()
    # Half a second of CPU, then a line, then idle until killed.
    burn = (
        "import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.5: pass\n"
        "print('done', flush=True)\n"
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"done"
        assert process_tree_cpu_seconds() - before >= 0.5
    finally:
        child.kill()
        child.wait()


def test_rounds_refuse_more_memory_than_the_device_has(tmp_path, capsys):
    """Engines alive together cannot each take most of the device memory:
    the error names the option and the largest share that fits."""
    with pytest.raises(SystemExit):
        main(
            ["--out", str(tmp_path), "--methods", "dflash,ddtree", "--budgets", "8,16",
             "--rounds", "2", "--gpu-memory-utilization", "0.5"]
        )  # fmt: skip
    err = capsys.readouterr().err
    assert "--gpu-memory-utilization 0.5 for each of 3 engines" in err
    assert "at most 0.32" in err


@pytest.mark.parametrize(("timeout", "reason"), [(120.0, "failed"), (0.5, "timed out")])
def test_a_lost_engine_is_reported_and_skipped(tmp_path, capfd, timeout, reason):
    """A worker that dies (no model at ``target``) or outlives the driver's
    wait is stopped, named in the log, and its rows are skipped."""
    job = {"tag": "nospec", "method": "nospec", "budget": None, "engine": {},
           "target": str(tmp_path / "missing"), "batch_sizes": [1],
           "result": str(tmp_path / "nospec.json")}  # fmt: skip
    worker = EngineWorker(job, tmp_path, timeout)
    worker.wait_ready()
    assert not worker.alive and worker.proc.returncode is not None
    worker.measure(1, 0.0, 0)
    worker.close()
    assert f"[bench_e2e] nospec {reason}" in capfd.readouterr().out
    assert not (tmp_path / "nospec.json").exists()


def test_output_digest_tells_outputs_apart():
    assert output_digest([1, 2, 3]) == output_digest([1, 2, 3])
    assert output_digest([1, 2, 3]) != output_digest([1, 2])
    assert output_digest([12, 3]) != output_digest([1, 23])


def _args(budgets, size_for_budget=None, async_scheduling=False):
    return SimpleNamespace(
        budgets=budgets, size_for_budget=size_for_budget,
        async_scheduling=async_scheduling, prompt_len=64, max_tokens=128,
        batch_sizes=[1, 16, 64], max_model_len=None, dtype="bfloat16",
        enforce_eager=True, gpu_memory_utilization=None, load_format="auto",
        target=str(TRAINED_TINY_DIR / "target"), max_cudagraph_capture_size=None,
        rounds=1, methods=["dflash", "ddtree"], kv_cache_gib=None,
    )  # fmt: skip


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_split_grid_keeps_one_set_of_engine_settings(async_scheduling):
    """Runs of one grid (baselines, small budgets, the widest budget) size
    their engines alike when each passes the grid's widest budget."""
    runs = [_args([15], 256), _args([16, 64], 256), _args([256], 256)]
    settings = []
    for args in runs:
        args.async_scheduling = async_scheduling
        args.max_model_len = _tokens_needed(args) + 1
        settings.append(_engine_settings(args))
    assert settings[0] == settings[1] == settings[2]
    tree = 256 * (2 if async_scheduling else 1)
    assert settings[0]["max_model_len"] == 64 + 128 + 1 + tree + 1 + 15 + 1
    # 64 trees of 257 nodes, and vLLM's drafting reserve of 15 per sequence.
    assert settings[0]["max_num_batched_tokens"] == 64 * (257 + 15)
    # Without it, each run sizes for its own widest draft.
    alone = _args([16, 64])
    alone.max_model_len = _tokens_needed(alone) + 1
    assert _engine_settings(alone)["max_num_batched_tokens"] == 64 * (65 + 15)


@pytest.mark.parametrize(
    ("config", "hybrid", "vision"),
    [
        ("qwen3-8b", False, False),
        ("qwen3next-9b", True, False),
        # Qwen3.5: the GDN layers are listed under text_config, and the
        # vision tower is left out of a text benchmark.
        ("qwen3.5-9b", True, True),
    ],
)
def test_engine_settings_follow_the_target_config(config, hybrid, vision):
    from pathlib import Path

    args = _args([64])
    args.target = str(Path(__file__).parents[1] / "benchmarks" / "configs" / config)
    args.max_model_len = _tokens_needed(args) + 1
    settings = _engine_settings(args)
    assert ("mamba_ssm_cache_dtype" in settings) == hybrid
    assert settings.get("language_model_only", False) == vision


def test_kv_cache_option_sizes_every_engine_alike():
    """``--kv-cache-gib`` becomes vLLM's ``kv_cache_memory_bytes`` (what lets
    GPU engines start at once); without it vLLM sizes the cache."""
    args = _args([64])
    args.max_model_len = _tokens_needed(args) + 1
    assert "kv_cache_memory_bytes" not in _engine_settings(args)
    args.kv_cache_gib = 1.5
    assert _engine_settings(args)["kv_cache_memory_bytes"] == 3 << 29


@pytest.mark.parametrize(
    ("on_gpu", "kv_cache_gib", "one_by_one"),
    [(True, None, True), (True, 4.0, False), (False, None, False)],
)
def test_engines_start_at_once_unless_sizing_their_kv_cache(
    monkeypatch, on_gpu, kv_cache_gib, one_by_one
):
    """GPU engines that size their KV caches from free memory start one
    after the other (each up before the next starts); with a given KV size,
    or on the CPU, all start before any is waited for."""
    import benchmarks.bench_e2e as bench

    events: list[tuple[str, str]] = []

    class Worker:
        def __init__(self, job, out, timeout):
            self.tag = job["tag"]
            events.append(("start", self.tag))

        def wait_ready(self):
            events.append(("ready", self.tag))

    monkeypatch.setattr(bench, "EngineWorker", Worker)
    monkeypatch.setattr(bench, "_on_gpu", lambda: on_gpu)
    args = SimpleNamespace(kv_cache_gib=kv_cache_gib, out=None, job_timeout=1)
    workers = start_engines([{"tag": "dflash"}, {"tag": "ddtree"}], args)
    assert [w.tag for w in workers] == ["dflash", "ddtree"]
    if one_by_one:
        assert events == [
            ("start", "dflash"), ("ready", "dflash"),
            ("start", "ddtree"), ("ready", "ddtree"),
        ]  # fmt: skip
    else:
        assert events == [("start", "dflash"), ("start", "ddtree")]


def test_schedule_option_reaches_ddtree_engines_only():
    """``--schedule`` becomes vLLM's batch-size schedule in DDTree's
    speculative config (which the plugin accepts), not in stock DFlash's."""
    from vllm_ddtree.config import parse_user_options

    schedule = parse_schedule("1-1:64,2-8:16,9:4")
    assert schedule == [[1, 1, 64], [2, 8, 16], [9, 9, 4]]
    job = dict(
        drafter="drafter", budget=64, fixed_budget=True, flash_context=False,
        schedule=schedule,
    )  # fmt: skip
    config = _speculative_config({**job, "method": "ddtree-v2"})
    assert config["num_speculative_tokens_per_batch_size"] == schedule
    assert parse_user_options(config)["num_speculative_tokens_per_batch_size"]
    dflash = _speculative_config({**job, "method": "dflash", "budget": DFLASH_DRAFTS})
    assert "num_speculative_tokens_per_batch_size" not in dflash
    with pytest.raises(argparse.ArgumentTypeError, match="FIRST-LAST:K"):
        parse_schedule("1-8")


def test_chain_steps_are_an_engine_per_setting():
    """``--chain-from 0,9`` gives DDTree on V2 an engine without chain steps
    and one with them from batch size 9 (its speculative config, accepted by
    the plugin, and its own rows in the table); other methods one engine."""
    from vllm_ddtree.config import parse_user_options

    args = SimpleNamespace(
        methods=["dflash", "ddtree-v2"], budgets=[64], chain_from=[0, 9]
    )
    jobs = _jobs(args)
    assert [(j["method"], j["chain_from"]) for j in jobs] == [
        ("dflash", None),
        ("ddtree-v2", None),
        ("ddtree-v2", 9),
    ]
    settings = dict(
        drafter="drafter", fixed_budget=True, flash_context=False, schedule=None
    )
    configs = [_speculative_config({**job, **settings}) for job in jobs]
    assert "chain_from_batch_size" not in configs[1]["ddtree"]
    assert configs[2]["ddtree"]["chain_from_batch_size"] == 9
    assert parse_user_options(configs[2])["ddtree"]["chain_from_batch_size"] == 9
    rows = [
        _row("dflash", 100.0, DFLASH_DRAFTS, adaptive_budget=False),
        _row("ddtree-v2", 90.0, 64, adaptive_budget=False),
        _row("ddtree-v2", 99.0, 64, adaptive_budget=False, chain_from=9),
    ]
    ratios = {r.get("chain_from"): r["vs_dflash"] for r in add_ratios(rows)[1:]}
    assert ratios == {None: pytest.approx(0.9), 9: pytest.approx(0.99)}
    assert "| ddtree-v2 chains from 9 | 64 fixed |" in table(add_ratios(rows))
    # Its own series in the plots, at the nodes it verified a step.
    rows[2]["nodes_per_draft"] = 15.0
    for r in rows:
        r["vs_nospec"] = r["tok_s"] / 100.0
    (series,) = speedup_series(rows, 0.0)
    assert series["ddtree"] == {
        "ddtree-v2": [(64, 0.9)],
        "ddtree-v2 chains from 9": [(15.0, 0.99)],
    }


@pytest.mark.parametrize(
    "args",
    [
        ["--methods", "dflash,ddtree", "--async-scheduling"],
        ["--methods", "dflash,ddtree-v2"],
    ],
)
def test_chain_steps_need_ddtree_on_v2_async(tmp_path, capsys, args):
    """``--chain-from`` is refused where no engine could take it (DDTree on
    the V1 runner) or none would start (synchronous scheduling)."""
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--fixed-budget", "--chain-from", "0,9", *args])
    assert "--chain-from needs --methods ddtree-v2 and --async-scheduling" in (
        capsys.readouterr().err
    )


def test_batch_schedule_from_adaptive_tree_sizes():
    """Mean tree sizes the adaptive budget chose at batch 1 / 4 / 16 / 64
    become ranges vLLM's schedule lookup reads back at every batch size."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = batch_schedule({1: 60.4, 4: 31.6, 16: 31.9, 64: 7.2})
    assert schedule == [[1, 3, 60], [4, 63, 32], [64, 64, 7]]
    lookup = build_dynamic_sd_schedule_lookup(schedule, 128, 64)
    assert [lookup[n] for n in (1, 3, 4, 63, 64, 128)] == [60, 60, 32, 32, 7, 7]
    # Measured from batch 4 only: batch sizes 1-3 take its size too (vLLM
    # would turn speculation off below a schedule's first range).
    assert batch_schedule({4: 0.2, 8: 3.0}) == [[1, 7, 1], [8, 8, 3]]


def test_batch_schedules_come_from_adaptive_ddtree_rows():
    rows = [
        _row("ddtree", 90.0, 64, batch=1, nodes_per_draft=40.2),
        _row("ddtree", 900.0, 64, batch=16, nodes_per_draft=9.6),
        _row("ddtree", 80.0, 16, batch=1, nodes_per_draft=16.0, adaptive_budget=False),
        _row("dflash", 70.0, DFLASH_DRAFTS, nodes_per_draft=15.0),
    ]
    assert batch_schedules(rows) == {"ddtree B=64 T=0": [[1, 15, 40], [16, 16, 10]]}


def test_batch_schedules_pick_the_fastest_fixed_budget():
    """Fixed-budget engines timed at several budgets give, per variant and
    temperature, the fastest budget at each batch size as a schedule; a
    variant timed at one budget gives none."""
    tok_s = {(1, 16): 80.0, (1, 64): 95.0, (16, 16): 900.0, (16, 64): 850.0,
             (64, 16): 2000.0, (64, 64): 1500.0}  # fmt: skip
    v2 = {"adaptive_budget": False, "async_scheduling": True}
    rows = [
        _row("ddtree-v2", t, budget, batch=batch, **v2)
        for (batch, budget), t in tok_s.items()
    ]
    rows.append(_row("ddtree", 70.0, 16, adaptive_budget=False))
    # An engine with chain steps is no fixed budget, however fast.
    rows.append(_row("ddtree-v2", 3000.0, 64, batch=64, chain_from=9, **v2))
    assert batch_schedules(rows) == {
        "ddtree-v2 async fastest fixed B T=0": [[1, 15, 64], [16, 64, 16]]
    }


def test_plots_take_every_ddtree_and_dflash_variant():
    """The V2 runner's and async rows are plotted (they were left out of both
    plots: their method names are not plain "ddtree" / "dflash"); a
    schedule's rows sit at the tree size they verified."""
    hist = [2, 1, 1]
    rows = add_ratios(
        [
            _row("nospec", 100.0, async_scheduling=True),
            _row("dflash", 200.0, DFLASH_DRAFTS, accept_hist=hist),
            _row("dflash", 210.0, DFLASH_DRAFTS, async_scheduling=True),
            _row("ddtree-v2", 300.0, 64, async_scheduling=True, accept_hist=hist),
            _row("ddtree", 250.0, 16, accept_hist=hist),
            _row("ddtree", 260.0, 64, accept_hist=hist),
            {**_row("ddtree-v2", 400.0, 64, schedule=[[1, 1, 64], [2, 64, 15]]),
             "batch": 16, "nodes_per_draft": 15.5},
            {**_row("dflash", 380.0, DFLASH_DRAFTS), "batch": 16},
            {**_row("nospec", 100.0), "batch": 16},
            {**_row("dflash", 1.0, DFLASH_DRAFTS, accept_hist=hist), "batch": 64},
        ]
    )  # fmt: skip
    batch_1, batch_16 = speedup_series(rows, 0.0)
    assert batch_1["ddtree"] == {
        "ddtree": [(16, 2.5), (64, 2.6)],
        "ddtree-v2 async": [(64, 3.0)],
    }
    assert batch_1["dflash"] == {"dflash": 2.0, "dflash async": 2.1}
    assert batch_16["batch"] == 16
    assert batch_16["ddtree"] == {"ddtree-v2": [(15.5, 4.0)]}
    names = [(r["method"], r["budget"]) for r in histogram_rows(rows)]
    assert names == [
        ("dflash", DFLASH_DRAFTS),
        ("ddtree", 16),
        ("ddtree", 64),
        ("ddtree-v2", 64),
    ]


def test_steady_run_returns_each_requests_own_output(fixtures):
    """``run_steady`` (requests kept in flight, a new one entering as one
    finishes) hands back every request's own output: requests of different
    lengths finish at different steps, so requests enter mid-run beside
    others, and greedy outputs still equal one batch of them all."""
    from vllm import SamplingParams

    from benchmarks.bench_e2e import run_steady
    from tests.utils import llm_engine

    prompts = [[(11 * k + 3 * j) % 200 + 5 for j in range(4 + k % 3)] for k in range(7)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3 + 2 * (k % 4)) for k in range(7)
    ]

    def request(k: int):
        return {"prompt_token_ids": prompts[k]}, params[k]

    with llm_engine(fixtures.dense_target, gpu_memory_utilization=0.25) as llm:
        steady = run_steady(llm, request, batch=2, enough=lambda n: n >= 7)
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert steady == [list(o.outputs[0].token_ids) for o in together]
    assert [len(ids) for ids in steady] == [p.max_tokens for p in params]
