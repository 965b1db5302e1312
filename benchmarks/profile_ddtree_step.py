# SPDX-License-Identifier: Apache-2.0
"""Where does a DDTree step's time go? One in-process engine, profiled.

Runs one engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
model runner's Python is visible), warms up on the exact request shape, then
times a decode of ``--max-tokens`` tokens and examines more decodes:

* ``phases.json``: host wall time per step of each engine phase (scheduler,
  the runner's input preparation, forward launch, sampler, state update,
  drafting, the bookkeeping sync that waits for the device, ...) and of
  each piece DDTree adds (lay-out, tree metadata, walk, commit, the
  drafter's hand-over) beside the stock pieces it adds to, measured with
  plain timers around those functions (inclusive: nested phases count in
  their callers too);
* ``stacks.txt``: every thread's wall time by innermost frames, sampled
  (waits included, where the timers and cProfile see only running code);
* ``cprofile.txt``: Python time by function (host-side overhead), the
  plugin's own functions apart, then the callers of every host-device sync
  (``.cpu()``, ``.item()``, ...);
* ``kernels.txt``: the torch profiler's per-op table sorted by device time,
  then by host time (launch counts show per-layer / per-depth loops);
* ``summary.json``: step time, the garbage collector's pauses in it, and
  the device's busy time per step from that profile: the difference is
  the GPU waiting for the host.

Dummy weights (``--load-format dummy``) accept nothing, so every step is a
full-budget DDTree step: the measure of its fixed cost. ``--pair DIR`` runs
a trained pair instead (real weights, its held-out prompts: steps that
accept). ``--method dflash`` / ``nospec`` profile stock DFlash and no
speculation with the same settings (with ``VLLM_USE_V2_MODEL_RUNNER=0`` on
V1, DDTree's runner); ``--runner v2`` puts DDTree on the V2 runner. The
phases are timed under V1's and V2's method names alike. Steps are counted
(the scheduler's calls), not derived from the token count.

    python benchmarks/profile_ddtree_step.py --out /tmp/prof \\
        --target benchmarks/configs/qwen3-8b \\
        --drafter benchmarks/configs/qwen3-8b-dflash --budget 64
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import faulthandler
import functools
import gc
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The repository's root, for ``benchmarks.bench_e2e`` when run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# (owner attribute path from the engine core, method names) timed per step.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("scheduler", ("schedule", "update_from_output")),
    (
        "runner",
        (
            "execute_model",
            # V1's runner
            "_prepare_inputs",
            "_build_attention_metadata",
            "_model_forward",
            "_sample",
            "_update_states_after_model_execute",
            "propose_draft_token_ids",
            "_bookkeeping_sync",
            # V2's runner
            "update_requests",
            "prepare_inputs",
            "prepare_attn",
            "sample",
            "_commit_path",
            "postprocess_sampled",
            # both
            "_plan_verify",
            "sample_tokens",
            "take_draft_token_ids",
        ),
    ),
    ("runner.rejection_sampler", ("forward",)),
    ("runner.drafter", ("propose", "_build_trees")),
    ("runner.speculator", ("propose",)),
)


# Functions timed where the step calls them (``module:attr`` or
# ``module:Class.attr``; class attributes are patched on the class, so
# ``__call__`` and inherited methods count too), for the host cost of each
# DDTree piece beside the stock ones it adds to. Inclusive, like PHASES.
FUNCTIONS: tuple[str, ...] = (
    # DDTree, V2 runner
    "vllm_ddtree.v1.worker.verify_plan:LayoutStager.__call__",
    # its misses (calls here against its own: a layout not kept)
    "vllm_ddtree.v1.worker.verify_plan:stage_layout",
    "vllm_ddtree.v1.worker.gpu.model_runner:lay_out_trees",
    "vllm_ddtree.v1.worker.gpu.model_runner:tree_attention_info",
    "vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler:path_first_targets",
    "vllm_ddtree.v1.worker.gpu.model_runner:compact_kv",
    "vllm_ddtree.v1.attention.backends.tree_attn:TreeMetadataBuilderMixin._attach_tree",
    "vllm_ddtree.v1.attention.backends.tree_attn:UniformTreeBuffers.fill",
    "vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler:"
    "TreeWalkSampler.__call__",
    "vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.rejection_sampler:walk_trees_triton",
    "vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator:DDTreeSpeculator.propose",
    "vllm_ddtree.v1.worker.gpu.spec_decode.ddtree.speculator:_permute_head",
    # the stock pieces beside them
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__",
    "vllm.v1.worker.gpu.sample.sampler:Sampler.sample",
    "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator.propose",
    "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder.build",
    # Attention, where it runs outside a full CUDA graph (mixed batches):
    # the tree layers' whole forward and their tree pass, and FlashAttention.
    "vllm_ddtree.v1.attention.backends.tree_attn:TreeAttentionImplMixin.forward",
    "vllm_ddtree.v1.attention.backends.flash_tree_attn:"
    "FlashTreeAttentionImpl._tree_forward",
    "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl.forward",
)


def _patch_functions(timed_by_label: Any) -> list[tuple[Any, str, Any]]:
    """Wrap every importable entry of :data:`FUNCTIONS` with
    ``timed_by_label(label, fn)``; returns what :func:`_unpatch` restores."""
    import importlib

    patched = []
    for entry in FUNCTIONS:
        module_name, _, qualname = entry.partition(":")
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        *outer, name = qualname.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        own = vars(owner).get(name)
        setattr(owner, name, functools.wraps(fn)(timed_by_label(qualname, fn)))
        patched.append((owner, name, own))
    return patched


def _unpatch(patched: list[tuple[Any, str, Any]]) -> None:
    for owner, name, own in reversed(patched):
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def _resolve(core: Any, path: str) -> Any:
    runner = core.model_executor.driver_worker.worker.model_runner
    obj = core
    for part in path.split("."):
        obj = runner if part == "runner" else getattr(obj, part, None)
    return obj


def time_phases(llm: Any, run: Any, steps: int) -> dict[str, dict[str, float]]:
    """Host wall time per step of each method in :data:`PHASES` during
    ``run()``, timed by wrappers set on the engine's instances (and removed
    afterwards); also per mixed and per decode-only step (see :class:`Step`),
    each phase counted in the step the runner last executed (the
    scheduler's, which run before the runner's, thus in the step before).
    Methods an engine does not have are left out."""
    core = llm.llm_engine.engine_core.engine_core
    totals: dict[tuple[str, bool], float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    # Executed steps by kind, and the kind of the last one.
    executed = {True: 0, False: 0}
    mixed = [False]

    def timed_by_label(label: str, method: Any) -> Any:
        def timed(*args, **kwargs):
            if label == "runner.execute_model":
                mixed[0] = bool(args[0].scheduled_new_reqs)
                executed[mixed[0]] += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                totals[label, mixed[0]] += time.perf_counter() - start
                calls[label] += 1

        return timed

    installed = []
    for path, names in PHASES:
        owner = _resolve(core, path)
        for name in names:
            method = getattr(owner, name, None) if owner is not None else None
            if method is None:
                continue
            wrapped = timed_by_label(f"{path}.{name}", method)
            setattr(owner, name, functools.wraps(method)(wrapped))
            installed.append((owner, name))
    patched = _patch_functions(timed_by_label)
    try:
        run()
    finally:
        _unpatch(patched)
        for owner, name in installed:
            delattr(owner, name)

    def per_step(label: str, kind: bool) -> float | None:
        count = executed[kind]
        return 1e3 * totals[label, kind] / count if count else None

    return {
        label: {
            "ms_per_step": 1e3 * (totals[label, True] + totals[label, False]) / steps,
            "calls": calls[label],
            "ms_per_mixed_step": per_step(label, True),
            "ms_per_decode_step": per_step(label, False),
        }
        for label in calls
    }


def gc_pauses(run: Any) -> dict[str, float]:
    """Python's garbage-collection pauses during ``run()``: collections and
    milliseconds by generation. A step that allocates many short-lived
    objects triggers collections, and a full (generation 2) one walks every
    tracked object of the process, the whole in-process engine's."""
    started: list[float] = []
    counts: dict[str, float] = defaultdict(float)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            gen = info["generation"]
            counts[f"gen{gen}_ms"] += 1e3 * (time.perf_counter() - started.pop())
            counts[f"gen{gen}_collections"] += 1

    gc.callbacks.append(on_gc)
    try:
        run()
    finally:
        gc.callbacks.remove(on_gc)
    return dict(counts)


def triton_compiles(run: Any) -> list[tuple[float, str]]:
    """The Triton kernels compiled during ``run()`` (when, and which): each
    launch whose specialisation (its arguments' dtypes, alignment, integers
    equal to 1 or divisible by 16) the kernel had not seen compiles a
    variant, or loads it from the disk cache, in that step. An engine warmed
    up on the same requests should compile none; one that does shows it as
    a slow step. Each is named with its compile-time arguments (which
    variant: e.g. a tile size no earlier step used)."""
    from triton import knobs

    compiled: list[tuple[float, str]] = []

    def on_compile(*, fn, compile, **_) -> None:
        names = fn.jit_function.arg_names
        constants = ", ".join(
            f"{names[path[0]]}={value}"
            for path, value in compile["constants"].items()
            if len(path) == 1
        )
        compiled.append((time.perf_counter(), f"{fn.name}({constants})"))

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = on_compile
    try:
        run()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return compiled


def wall_stacks(run: Any, interval_s: float = 2e-4, depth: int = 6) -> str:
    """Where each thread's wall time goes during ``run()``: a sampler thread
    reads every thread's stack (``sys._current_frames``) each
    ``interval_s``, and the report lists each thread's most frequent
    innermost ``depth`` frames with their share of its samples. Unlike the
    phase timers and cProfile this counts time spent waiting (a CUDA event,
    a lock, a sleep) where the wait is. Python's thread switch interval is
    lowered meanwhile so that a thread running Python cannot keep the
    sampler out for the default 5 ms."""
    counts: Counter[tuple[int, str]] = Counter()
    stop = threading.Event()
    names = {t.ident: t.name for t in threading.enumerate()}

    def sample() -> None:
        me = threading.get_ident()
        while not stop.wait(interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                frames = []
                while frame is not None and len(frames) < depth:
                    code = frame.f_code
                    frames.append(
                        f"{os.path.basename(code.co_filename)}:{frame.f_lineno}"
                        f"({code.co_name})"
                    )
                    frame = frame.f_back
                counts[(ident, " < ".join(frames))] += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(interval_s / 2)
    sampler = threading.Thread(target=sample, name="wall-stacks", daemon=True)
    sampler.start()
    try:
        run()
    finally:
        stop.set()
        sampler.join()
        sys.setswitchinterval(switch)
    names.update((t.ident, t.name) for t in threading.enumerate())
    per_thread: Counter[int] = Counter()
    for (ident, _), n in counts.items():
        per_thread[ident] += n
    lines = []
    for ident, total in per_thread.most_common():
        lines.append(f"== thread {names.get(ident, ident)}: {total} samples")
        top = [(st, n) for (i, st), n in counts.most_common() if i == ident]
        lines += [f"{100 * n / total:6.1f}%  {st}" for st, n in top[:25]]
    return "\n".join(lines) + "\n"


class Step(NamedTuple):
    """One engine step: when the scheduler was called, and whether the step
    scheduled a new request (a prefill beside the decodes: a mixed batch,
    which vLLM cannot replay as a full CUDA graph)."""

    start: float
    mixed: bool


def count_steps(llm: Any, run: Any) -> list[Step]:
    """The engine steps (the scheduler's calls) during ``run()``."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule = scheduler.schedule
    steps: list[Step] = []

    def counted(*args, **kwargs):
        start = time.perf_counter()
        output = schedule(*args, **kwargs)
        steps.append(Step(start, bool(output.scheduled_new_reqs)))
        return output

    scheduler.schedule = counted
    try:
        run()
    finally:
        del scheduler.schedule
    return steps


def step_times(
    steps: list[Step],
    compiled: list[tuple[float, str]] = (),
    num_slowest: int = 5,
) -> dict[str, Any]:
    """Median and mean milliseconds from a step's start to the next one's,
    over all steps and over the mixed and the decode-only ones apart, the
    share of mixed steps and the ``num_slowest`` longest steps (their
    index, ms, whether mixed and the Triton kernels ``compiled`` in them,
    see :func:`triton_compiles`: a mean far above its median is a few such
    steps). Medians and means leave out ``generate()``'s fixed costs
    (request intake, output assembly), which ``ms_per_step`` spreads over
    the steps (most visible for a short decode of few long steps, DDTree at
    batch 1). Under async scheduling a step's host work overlaps the
    previous step's device work, so the split is by where the host spent
    the gap."""
    gaps = [(b.start - a.start, a.mixed) for a, b in itertools.pairwise(steps)]
    slowest = sorted(enumerate(gaps), key=lambda item: -item[1][0])[:num_slowest]
    starts = [step.start for step in steps]

    def compiled_in(i: int) -> list[str]:
        return [name for when, name in compiled if bisect.bisect(starts, when) == i + 1]

    times: dict[str, Any] = {}
    for kind, name in ((None, "step"), (True, "mixed_step"), (False, "decode_step")):
        chosen = [gap for gap, mixed in gaps if kind is None or mixed == kind]
        for stat in (statistics.median, statistics.mean):
            value = 1e3 * stat(chosen) if chosen else None
            times[f"{stat.__name__}_{name}_ms"] = value
    return {
        **times,
        "mixed_step_share": sum(mixed for _, mixed in gaps) / max(len(gaps), 1),
        "slowest_steps": [
            {"step": i, "ms": 1e3 * gap, "mixed": mixed, "compiled": compiled_in(i)}
            for i, (gap, mixed) in slowest
        ],
        "triton_compiles": len(compiled),
    }


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The engine's ``speculative_config`` for ``--method``: DDTree with a
    fixed budget ``--budget`` (sized by batch size under ``--schedule``, as
    ``bench_e2e.py``'s rows are; chain steps from ``--chain-from``), or
    stock DFlash's 15-token chains."""
    if args.method == "ddtree":
        spec = {
            "method": "ddtree",
            "model": args.drafter,
            "num_speculative_tokens": args.budget,
            "ddtree": {"adaptive_budget": False, "model_runner": args.runner},
        }
        if args.schedule:
            spec["num_speculative_tokens_per_batch_size"] = args.schedule
        if args.chain_from:
            spec["ddtree"]["chain_from_batch_size"] = args.chain_from
        return spec
    if args.method == "dflash":
        return {"method": "dflash", "model": args.drafter, "num_speculative_tokens": 15}
    return None


def main() -> None:
    from benchmarks.bench_e2e import host_reference_ms, parse_schedule, run_steady

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model (config) dir")
    ap.add_argument("--drafter", help="DFlash drafter (config) dir")
    ap.add_argument(
        "--pair",
        type=Path,
        help="a trained pair (train_pair's output): real weights and prompts",
    )
    ap.add_argument(
        "--runner",
        choices=("v1", "v2"),
        default="v1",
        help="DDTree's model runner (ddtree.model_runner)",
    )
    ap.add_argument("--max-cudagraph-capture-size", type=int)
    ap.add_argument(
        "--method", choices=("ddtree", "dflash", "nospec"), default="ddtree"
    )
    ap.add_argument("--budget", type=int, default=64, help="DDTree's tree budget B")
    ap.add_argument(
        "--schedule",
        type=parse_schedule,
        help="DDTree's trees by batch size, FIRST-LAST:K,... (vLLM's "
        "num_speculative_tokens_per_batch_size; K <= --budget)",
    )
    ap.add_argument(
        "--chain-from",
        type=int,
        help="DDTree on V2: DFlash chain steps from this batch size "
        "(ddtree.chain_from_batch_size)",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature (T > 0: seeded per request, for repeatable steps)",
    )
    ap.add_argument("--prompt-len", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduling (host phases then overlap the GPU's)",
    )
    ap.add_argument(
        "--decode-timeout",
        type=float,
        default=60.0,
        help="seconds a decode may take before every thread's stack is "
        "printed and the run ends (a hung step names itself)",
    )
    ap.add_argument(
        "--steady-requests",
        type=int,
        default=0,
        help="keep --batch requests in flight, a new one entering as one "
        "finishes, until this many were submitted (prefills mixed into the "
        "decode steps, as a server sees them); 0: one wave of --batch",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    prompt_ids = None
    if args.pair is not None:
        from vllm_ddtree.fixtures import trained_pair

        pair = trained_pair(args.pair)
        args.target, args.drafter = str(pair.target), str(pair.drafter)
        args.load_format = "auto"
        with open(pair.prompts) as fh:
            prompt_ids = [json.loads(line)["prompt_token_ids"] for line in fh]
    elif not (args.target and args.drafter):
        ap.error("--target and --drafter, or --pair")

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = speculative_config(args)
    llm = LLM(
        model=args.target,
        load_format=args.load_format,
        skip_tokenizer_init=args.load_format == "dummy",
        # The last step verifies 1 + B nodes and then drafts 1 + 15
        # positions: vLLM skips the drafter when those would not fit (under
        # async scheduling counting up to B rejected nodes more).
        max_model_len=args.prompt_len
        + args.max_tokens
        + max(args.budget, 16) * (2 if args.async_scheduling else 1)
        + 19,
        max_num_seqs=max(args.batch, 4),
        gpu_memory_utilization=0.85,
        speculative_config=spec,
        async_scheduling=args.async_scheduling,
        compilation_config=None
        if args.max_cudagraph_capture_size is None
        else {"max_cudagraph_capture_size": args.max_cudagraph_capture_size},
    )
    if prompt_ids is None:
        length = range(args.prompt_len)
        prompt_ids = [
            [(7 * i + 13 * r) % 1000 + 5 for i in length] for r in range(args.batch)
        ]

    def request(k: int) -> tuple[TokensPrompt, SamplingParams]:
        return TokensPrompt(
            prompt_token_ids=prompt_ids[k % len(prompt_ids)][-args.prompt_len :]
        ), SamplingParams(
            temperature=args.temperature,
            seed=k if args.temperature > 0 else None,
            max_tokens=args.max_tokens,
            ignore_eos=True,
        )

    num_requests = args.steady_requests or args.batch

    def enough(submitted: int) -> bool:
        return submitted >= num_requests

    def decode() -> None:
        # The engine runs in this process: on a hang, the stacks show where.
        faulthandler.dump_traceback_later(args.decode_timeout, exit=True)
        try:
            if args.steady_requests:
                run_steady(llm, request, args.batch, enough)
            else:
                prompts, params = zip(*map(request, range(args.batch)), strict=True)
                llm.generate(list(prompts), list(params), use_tqdm=False)
        finally:
            faulthandler.cancel_dump_traceback_later()

    # Warm-up on the exact shape, twice: the first run caches the prompts'
    # prefixes, so the timed run's first step (short prefills only) has the
    # second run's shapes.
    for _ in range(2):
        decode()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    host_ref_ms = host_reference_ms()
    start = time.perf_counter()
    pauses: dict[str, float] = {}
    compiled: list[tuple[float, str]] = []

    def timed_decode() -> None:
        pauses.update(gc_pauses(decode))

    counted = count_steps(llm, lambda: compiled.extend(triton_compiles(timed_decode)))
    seconds = time.perf_counter() - start
    # The host's speed around the timed run, to compare profiles by.
    host_ref_ms = (host_ref_ms + host_reference_ms()) / 2
    steps = len(counted)
    summary = {
        "method": args.method,
        "budget": args.budget,
        "batch": args.batch,
        "temperature": args.temperature,
        "runner": args.runner,
        "async_scheduling": args.async_scheduling,
        "steps": steps,
        "steady_requests": args.steady_requests,
        "tokens_per_step": num_requests * args.max_tokens / steps,
        "seconds": seconds,
        "ms_per_step": 1e3 * seconds / steps,
        **step_times(counted, compiled),
        "gc_ms_per_step": sum(v for k, v in pauses.items() if k.endswith("_ms"))
        / steps,
        "gc": pauses,
        "host_ref_ms": host_ref_ms,
    }
    print(json.dumps(summary), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    phases = time_phases(llm, decode, steps)
    print("ms/step (all, mixed, decode-only), calls, phase")
    (args.out / "phases.json").write_text(json.dumps(phases, indent=2))
    for label, row in phases.items():
        split = "  ".join(
            f"{row[key]:8.3f}" if row[key] is not None else f"{'-':>8}"
            for key in ("ms_per_mixed_step", "ms_per_decode_step")
        )
        print(f"{row['ms_per_step']:8.3f}  {split}  {row['calls']:5d}x  {label}")

    (args.out / "stacks.txt").write_text(wall_stacks(decode))

    prof = cProfile.Profile()
    prof.enable()
    decode()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    # The plugin's own functions, however far down the overall lists.
    stats.sort_stats("cumulative").print_stats("vllm_ddtree", 80)
    # Who waits for the device: every caller of a host-device sync.
    stats.print_callers(r"method '(cpu|item|tolist|synchronize)'")
    # Where the speculator's and the sampler's time goes, call by call
    # (their own lines above sum their callees' time, GPU waits included).
    stats.print_callees(r"speculator.py:\d+\(propose\)|rejection_sampler.py.*__call__")
    (args.out / "cprofile.txt").write_text(text.getvalue())

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu
    with profile(activities=activities) as p:
        decode()
    averages = p.key_averages()
    tables = [averages.table(sort_by="cpu_time_total", row_limit=40)]
    if on_gpu:
        # Device busy time (every op's own kernels and copies, graph
        # replays included) against the wall time of a step: the rest is
        # the GPU waiting for the host.
        device_ms = sum(e.self_device_time_total for e in averages) / 1e3 / steps
        summary["device_ms_per_step"] = device_ms
        summary["device_idle_ms_per_step"] = summary["ms_per_step"] - device_ms
        tables.insert(0, averages.table(sort_by="cuda_time_total", row_limit=40))
    print(json.dumps(summary), flush=True)
    (args.out / "kernels.txt").write_text("\n\n".join(tables))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
