# SPDX-License-Identifier: Apache-2.0
"""Soak test: a DDTree server under mixed, concurrent OpenAI traffic.

Starts two servers on loopback (``vllm-ddtree serve``, same target and
settings): one with DDTree, one without speculation (the reference). For
``--minutes`` (or until ``--max-requests``), ``--concurrency`` clients send
the DDTree server requests drawn at random from:

* greedy, or sampled (temperature, top-p, sometimes a seed; ``n`` = 1 or 2);
* completions with token-id prompts, or chat with text;
* streamed (with usage) or not; some streams are dropped after a few chunks
  and some plain requests are given up after a fraction of a second (aborts);
* stop strings;
* long prompts: prompt + ``max_tokens`` reaching ``max_model_len`` exactly or
  nearly, and a few exceeding it, which must be answered with HTTP 400.

Checks (each a line of the report; exit status 1 if any fails):

* no HTTP 5xx, no error inside a stream, no connection failure, no request
  past ``--request-timeout``, HTTP 400 exactly for the over-long prompts;
* server memory: resident set size of the server's whole process tree when
  idle after a warm-up phase and when idle at the end; growth must stay under
  ``--max-rss-growth-mb`` (or ``--max-rss-growth-frac`` of the warm value);
* every finished greedy request gives the same text, finish reason and token
  count when replayed on the reference server.

It also reports throughput, the per-request DDTree stats returned with
``--enable-per-request-metrics`` and the engine's acceptance counters.

Usage::

    # CPU, the bundled tiny models (what tests/test_soak.py runs)
    python benchmarks/soak.py --fixtures --concurrency 4 --minutes 0.25

    # GPU, 10 minutes (both servers share the GPU)
    python benchmarks/soak.py --target Qwen/Qwen3-8B \\
        --drafter z-lab/Qwen3-8B-DFlash-b16 --budget 64 --max-model-len 4096 \\
        --concurrency 32 --minutes 10 --max-tokens 256 \\
        --server-arg=--gpu-memory-utilization=0.4 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.utils import OpenAIServer  # noqa: E402

MODEL = "soak"
_WORDS = ("the", "cat", "sat", "on", "a", "tree", "river", "light", "stone", "blue")
_STOP_STRINGS = ("e", "a ", "th", "\n", ".")


# -- requests ------------------------------------------------------------------


@dataclass
class Plan:
    """One request: what to send and what to expect."""

    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]
    greedy: bool
    stream: bool
    abort_after_chunks: int | None = None  # stream: drop it after this many
    abort_after_s: float | None = None  # non-stream: give up after this long
    expect_400: bool = False
    tags: tuple[str, ...] = ()


def make_plan(rng: random.Random, args: argparse.Namespace, vocab: int) -> Plan:
    tags: list[str] = []
    greedy = rng.random() < args.greedy_fraction
    max_tokens = rng.randint(4, args.max_tokens)
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens}
    if greedy:
        body["temperature"] = 0.0
        tags.append("greedy")
    else:
        body.update(temperature=rng.choice([0.6, 1.0]), top_p=rng.choice([0.9, 1.0]))
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            body["n"] = 2
            tags.append("n>1")
        tags.append("sampled")
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(_STOP_STRINGS)]
        tags.append("stop")

    expect_400 = False
    if rng.random() < 0.3:
        endpoint = "chat"
        words = [rng.choice(_WORDS) for _ in range(rng.randint(2, 24))]
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        endpoint = "completions"
        roll = rng.random()
        # Prompt + max_tokens may reach max_model_len, not exceed it.
        room = args.max_model_len - max_tokens
        if roll < args.long_fraction:
            length = room - rng.randint(0, 2)
            tags.append("long")
        elif roll < args.long_fraction + args.too_long_fraction:
            length = room + rng.randint(1, 8)
            expect_400 = True
            tags.append("too-long")
        elif roll < args.long_fraction + args.too_long_fraction + args.tree_fraction:
            # Admitted beside verifying requests, a prompt as long as a full
            # tree makes a uniform batch that is not all trees.
            length = min(1 + args.budget, room)
            tags.append("tree-sized")
        else:
            length = rng.randint(1, min(48, room))
        body["prompt"] = [rng.randrange(10, vocab) for _ in range(length)]

    stream = rng.random() < args.stream_fraction
    plan = Plan(endpoint, body, greedy, stream, expect_400=expect_400)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        tags.append("stream")
        if rng.random() < args.abort_fraction:
            plan.abort_after_chunks = rng.randint(1, 3)
            tags.append("abort")
    elif rng.random() < args.abort_fraction / 2:
        plan.abort_after_s = rng.uniform(0.02, 0.5)
        tags.append("abort")
    plan.tags = tuple(tags)
    return plan


@dataclass
class Outcome:
    plan: Plan
    status: str  # ok | aborted | expected_400 | failure kinds (see FAILURES)
    detail: str = ""
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    completion_tokens: int | None = None
    ddtree: dict[str, Any] | None = None

    def add_choices(self, choices: list[Any], stream: bool) -> None:
        """Append the text and finish reason of ``choices`` (a response's,
        or one stream chunk's) to the per-index results."""
        for choice in choices:
            while len(self.texts) <= choice.index:
                self.texts.append("")
                self.finish_reasons.append(None)
            self.texts[choice.index] += _choice_text(choice, self.plan.endpoint, stream)
            if choice.finish_reason is not None:
                self.finish_reasons[choice.index] = choice.finish_reason


FAILURES = (
    "http_5xx",
    "stream_error",
    "connection_error",
    "timeout",
    "unexpected_4xx",
    "missing_400",
)


def _choice_text(choice: Any, endpoint: str, stream: bool) -> str:
    if endpoint == "chat":
        return (choice.delta if stream else choice.message).content or ""
    return choice.text


def make_client(url: str, args: argparse.Namespace) -> openai.AsyncOpenAI:
    """An OpenAI client for one server, never retrying on its own."""
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        timeout=args.request_timeout,
        max_retries=0,
    )


async def send(client: openai.AsyncOpenAI, plan: Plan) -> Outcome:
    """Send ``plan``; never raises for server-side problems (they are
    outcomes)."""
    create = (
        client.chat.completions.create
        if plan.endpoint == "chat"
        else client.completions.create
    )
    out = Outcome(plan, "ok")
    try:
        if plan.stream:
            stream = await create(**plan.body)
            chunks = 0
            try:
                async for chunk in stream:
                    chunks += 1
                    out.add_choices(chunk.choices, stream=True)
                    if chunk.usage is not None:
                        out.completion_tokens = chunk.usage.completion_tokens
                        out.ddtree = _ddtree_of(chunk)
                    if plan.abort_after_chunks and chunks >= plan.abort_after_chunks:
                        out.status = "aborted"
                        break
            finally:
                await stream.close()
        else:
            call = create(**plan.body)
            if plan.abort_after_s is not None:
                try:
                    response = await asyncio.wait_for(call, plan.abort_after_s)
                except asyncio.TimeoutError:
                    return Outcome(plan, "aborted")
            else:
                response = await call
            out.add_choices(response.choices, stream=False)
            out.completion_tokens = response.usage.completion_tokens
            out.ddtree = _ddtree_of(response)
    except openai.APIStatusError as e:
        if e.status_code >= 500:
            return Outcome(plan, "http_5xx", f"{e.status_code}: {e.message}")
        if e.status_code == 400 and plan.expect_400:
            return Outcome(plan, "expected_400")
        return Outcome(plan, "unexpected_4xx", f"{e.status_code}: {e.message}")
    except openai.APITimeoutError as e:
        return Outcome(plan, "timeout", str(e))
    except openai.APIConnectionError as e:
        return Outcome(plan, "connection_error", str(e))
    except openai.APIError as e:  # an error event inside a 200 stream
        return Outcome(plan, "stream_error", str(e))
    if plan.expect_400:
        return Outcome(plan, "missing_400", "an over-long prompt was served")
    return out


def _ddtree_of(response: Any) -> dict[str, Any] | None:
    metrics = (response.model_extra or {}).get("metrics") or {}
    return metrics.get("ddtree")


# -- memory --------------------------------------------------------------------


def tree_rss(pid: int) -> int:
    """Resident set size of a process and all its descendants, in bytes (0
    once the process is gone: the report's ``servers`` entry says why)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total


async def sample_rss(pid: int, samples: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(tree_rss(pid))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


# -- the soak ------------------------------------------------------------------


async def load_phase(
    server: OpenAIServer,
    args: argparse.Namespace,
    vocab: int,
    seconds: float,
    max_requests: int,
    first_index: int,
) -> list[Outcome]:
    """``args.concurrency`` clients, each sending one request at a time, for
    ``seconds`` or ``max_requests`` requests, or until the server exits;
    returns when all are done."""
    client = make_client(server.url, args)
    deadline = time.monotonic() + seconds
    outcomes: list[Outcome] = []
    next_index = iter(range(first_index, first_index + max_requests))

    async def client_loop() -> None:
        while time.monotonic() < deadline and server.exit_code is None:
            index = next(next_index, None)
            if index is None:
                return
            plan = make_plan(random.Random(args.seed * 1_000_003 + index), args, vocab)
            outcomes.append(await send(client, plan))

    try:
        await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    finally:
        await client.close()
    return outcomes


async def replay_greedy(
    url: str, outcomes: list[Outcome], args: argparse.Namespace
) -> tuple[int, list[dict[str, Any]]]:
    """Replay finished greedy requests on ``url``; return how many, and the
    mismatches."""
    client = make_client(url, args)
    todo = [o for o in outcomes if o.status == "ok" and o.plan.greedy]
    semaphore = asyncio.Semaphore(args.concurrency)
    mismatches: list[dict[str, Any]] = []

    async def one(outcome: Outcome) -> None:
        body = dict(outcome.plan.body)
        body.pop("stream", None)
        body.pop("stream_options", None)
        plan = Plan(outcome.plan.endpoint, body, True, False)
        async with semaphore:
            ref = await send(client, plan)
        got = [outcome.texts, outcome.finish_reasons, outcome.completion_tokens]
        want = [ref.texts, ref.finish_reasons, ref.completion_tokens]
        if "stop" in body:
            # vLLM cuts the text at a stop string but counts every token of
            # the step that completed it: with speculation a step brings
            # several, so only text and finish reason are comparable.
            got[2] = want[2] = None
        if ref.status != "ok" or got != want:
            agree = os.path.commonprefix(
                [(outcome.texts or [""])[0], (ref.texts or [""])[0]]
            )
            mismatches.append(
                {
                    "request": outcome.plan.body,
                    "same_text_chars": len(agree),
                    "ddtree": got,
                    "reference": want,
                    "reference_status": ref.status,
                }
            )

    try:
        await asyncio.gather(*(one(o) for o in todo))
    finally:
        await client.close()
    return len(todo), mismatches


def engine_acceptance(url: str) -> dict[str, Any]:
    """Engine-wide spec-decode counters from Prometheus."""
    try:
        text = requests.get(f"{url}/metrics", timeout=30).text
    except requests.RequestException as e:  # the server died: say so
        return {"error": str(e)}
    wanted = {
        "vllm:spec_decode_num_drafts_total": "drafts",
        "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
    }
    totals = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    if totals["drafts"]:
        totals["mean_acceptance_length"] = (
            1 + totals["accepted_tokens"] / (totals["drafts"])
        )
    return totals


async def soak(args: argparse.Namespace, ddtree: OpenAIServer, reference: OpenAIServer):
    from transformers import AutoTokenizer

    vocab = min(len(AutoTokenizer.from_pretrained(args.target)), 32_000)
    duration = args.minutes * 60
    warmup_s = min(args.warmup_seconds, duration / 3)
    started = time.monotonic()
    samples: list[int] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(ddtree.pid, samples, stop))
    try:
        outcomes = await load_phase(ddtree, args, vocab, warmup_s, args.max_requests, 0)
        await asyncio.sleep(args.idle_seconds)
        rss_warm = tree_rss(ddtree.pid)
        outcomes += await load_phase(
            ddtree,
            args,
            vocab,
            duration - warmup_s,
            args.max_requests - len(outcomes),
            len(outcomes),
        )
        elapsed = time.monotonic() - started
        await asyncio.sleep(args.idle_seconds)
        rss_end = tree_rss(ddtree.pid)
    finally:
        stop.set()
        await sampler
    compared, mismatches = await replay_greedy(reference.url, outcomes, args)
    servers = {"ddtree": server_health(ddtree), "reference": server_health(reference)}
    return build_report(
        args, outcomes, elapsed, rss_warm, rss_end, samples, compared, mismatches,
        servers,
    ) | {"engine": engine_acceptance(ddtree.url)}  # fmt: skip


def server_health(server: OpenAIServer) -> dict[str, Any]:
    """Whether ``server`` still runs; if not, its exit status and the end of
    its log (a server that died mid-soak fails every later request, and the
    log is the only record of why)."""
    code = server.exit_code
    if code is None:
        return {"alive": True}
    return {"alive": False, "exit_code": code, "log_tail": server.log_tail()}


def build_report(
    args, outcomes, elapsed, rss_warm, rss_end, samples, compared, mismatches, servers
) -> dict[str, Any]:
    status = Counter(o.status for o in outcomes)
    tags = Counter(t for o in outcomes for t in o.plan.tags)
    tokens = sum(o.completion_tokens or 0 for o in outcomes if o.status == "ok")
    rounds = [o.ddtree for o in outcomes if o.ddtree and o.ddtree["decode_rounds"]]
    total_rounds = sum(d["decode_rounds"] for d in rounds)
    mib = 1 << 20
    growth = rss_end - rss_warm
    allowed = max(args.max_rss_growth_mb * mib, args.max_rss_growth_frac * rss_warm)
    failures = {kind: status[kind] for kind in FAILURES if status[kind]}
    examples = [
        {"status": o.status, "detail": o.detail[:500], "request": o.plan.tags}
        for o in outcomes
        if o.status in FAILURES
    ][:10]
    checks = {
        "no_failed_requests": not failures,
        "rss_growth_within_limit": growth <= allowed,
        "greedy_equals_reference": compared > 0 and not mismatches,
        "servers_alive": all(h["alive"] for h in servers.values()),
    }
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "requests": len(outcomes),
        "status": dict(status),
        "failures": failures,
        "failure_examples": examples,
        "kinds": dict(tags),
        "seconds": round(elapsed, 1),
        "completion_tokens": tokens,
        "tokens_per_second": round(tokens / elapsed, 1) if elapsed else None,
        "rss_mib": {
            "warm_idle": round(rss_warm / mib, 1),
            "end_idle": round(rss_end / mib, 1),
            "growth": round(growth / mib, 1),
            "allowed_growth": round(allowed / mib, 1),
            "max_sampled": round(max(samples, default=0) / mib, 1),
        },
        "greedy_compared": compared,
        "greedy_mismatches": mismatches[:10],
        "num_greedy_mismatches": len(mismatches),
        # Of those, replays the reference server did not answer (a dead
        # reference makes every comparison fail without saying DDTree erred).
        "num_greedy_unreplayed": sum(m["reference_status"] != "ok" for m in mismatches),
        "per_request_ddtree": {
            "requests": len(rounds),
            "mean_acceptance_length": (
                sum(d["mean_acceptance_length"] * d["decode_rounds"] for d in rounds)
                / total_rounds
                if total_rounds
                else None
            ),
        },
        "servers": servers,
        "config": {
            k: v for k, v in vars(args).items() if k not in ("out", "server_arg")
        }
        | {"server_args": args.server_arg},
    }


# -- command line --------------------------------------------------------------


def server_args(args: argparse.Namespace, speculative: bool) -> list[str]:
    out = [
        "--served-model-name",
        MODEL,
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        "0",
        *args.server_arg,
    ]
    if args.kv_cache_gib:
        out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    if speculative:
        spec = {
            "method": "ddtree",
            "model": args.drafter,
            "num_speculative_tokens": args.budget,
        }
        out += ["--speculative-config", json.dumps(spec)]
        out += ["--enable-per-request-metrics"]
    return out


def server_envs() -> list[dict[str, str]]:
    """Environments of the DDTree and the reference server.

    On a CPU install vLLM binds each server's worker threads on its own, so
    both would share the same cores; unless the user chose a binding, each
    server gets half of this process's cores.
    """
    from vllm.platforms import current_platform

    envs: list[dict[str, str]] = [{}, {}]
    if not current_platform.is_cpu():
        return envs
    cores = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and len(cores) >= 2:
        half = len(cores) // 2
        for env, part in zip(envs, (cores[:half], cores[half:]), strict=True):
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, part))
    return envs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", help="target model (path or HF name)")
    p.add_argument("--drafter", help="DFlash drafter (path or HF name)")
    p.add_argument(
        "--fixtures",
        action="store_true",
        help="use the bundled tiny models (python -m vllm_ddtree.fixtures)",
    )
    p.add_argument("--budget", type=int, default=16, help="DDTree budget B")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8, help="N client streams")
    p.add_argument("--minutes", type=float, default=1.0, help="M, load time")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--warmup-seconds", type=float, default=60.0)
    p.add_argument("--idle-seconds", type=float, default=2.0)
    p.add_argument("--greedy-fraction", type=float, default=0.5)
    p.add_argument("--stream-fraction", type=float, default=0.7)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--too-long-fraction", type=float, default=0.02)
    p.add_argument(
        "--tree-fraction",
        type=float,
        default=0.05,
        help="share of prompts exactly 1 + budget tokens long",
    )
    p.add_argument("--max-rss-growth-mb", type=float, default=128.0)
    p.add_argument("--max-rss-growth-frac", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for both servers, e.g. "
        "--server-arg=--gpu-memory-utilization=0.4 (repeatable)",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        help="give each server a KV cache of this size (vLLM's "
        "--kv-cache-memory-bytes) instead of sizing it from free memory; GPU "
        "servers then start at once, not one after the other",
    )
    p.add_argument("--log-dir", type=Path, help="keep the servers' logs here")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.fixtures:
        from vllm_ddtree.fixtures import fixture_paths

        paths = fixture_paths()
        args.target = args.target or str(paths.dense_target)
        args.drafter = args.drafter or str(paths.dense_drafter)
    if not (args.target and args.drafter):
        p.error("give --target and --drafter, or --fixtures")
    if not 4 <= args.max_tokens < args.max_model_len - 2:
        p.error("--max-tokens must be at least 4 and below --max-model-len - 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The client's HTTP stack imports part of itself when the first client is
    # made (on the H200 bundle that once failed on a missing ``truststore``):
    # make one now, before minutes of server start-up.
    asyncio.run(make_client("http://127.0.0.1:1", args).close())
    logs = args.log_dir
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    servers = [
        OpenAIServer(
            args.target,
            server_args(args, speculative),
            env=env,
            startup_timeout=args.startup_timeout,
            log_path=logs / f"{name}.log" if logs else None,
        )
        for (name, speculative), env in zip(
            (("ddtree", True), ("reference", False)), server_envs(), strict=True
        )
    ]
    from vllm.platforms import current_platform

    # On a GPU the servers start one after the other unless their KV caches
    # have a given size: each sizes its KV cache from the memory it sees
    # free while profiling, which the other's start would change under it.
    # CPU servers start at once.
    one_by_one = not current_platform.is_cpu() and not args.kv_cache_gib
    with contextlib.ExitStack() as stack:
        for server in servers:
            server.start()
            stack.callback(server.stop)
            if one_by_one:
                server.wait_ready()
        for server in servers:
            server.wait_ready()
        report = asyncio.run(soak(args, *servers))
    text = json.dumps(report, indent=2, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)
    print("SOAK PASSED" if report["passed"] else "SOAK FAILED", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
