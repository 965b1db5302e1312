# SPDX-License-Identifier: Apache-2.0
"""Generate with DDTree and print the text and the acceptance statistics.

    python -m vllm_ddtree.demo                       # bundled trained tiny pair (CPU)
    python -m vllm_ddtree.demo --random-fixtures     # random-weight test fixtures
    python -m vllm_ddtree.demo --model M --drafter D --budget 64   # your own

The bundled pair is a small Python-code LM and a DFlash drafter distilled from
it (``vllm_ddtree/assets/trained-tiny``, see docs/benchmarks.md), so its
acceptance statistics are real; the default prompts are code.

With ``--compare`` it also runs the same prompts without speculation and
reports the speed ratio and, at temperature 0, whether the outputs are
identical; where they are not, the first differing token and whether it is a
near-tie of no-spec's log-probabilities (see ``greedy_ties.py``: bf16
rounding may order such a pair either way) or a real difference.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "    for i, line in enumerate(lines):\n        if ",
]


@dataclass
class RunResult:
    texts: list[str]
    token_ids: list[list[int]]
    seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    # Per prompt and generated token, the top-2 log-probability gap (runs
    # that asked for log-probabilities only).
    gaps: list[list[float]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verify round: accepted drafts plus the bonus."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")


def _run(
    args, prompts: list[str], speculative_config: dict | None, gaps: bool = False
) -> RunResult:
    from vllm import LLM, SamplingParams

    from vllm_ddtree.greedy_ties import top2_gaps

    llm = LLM(
        model=args.model,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        logprobs=2 if gaps else None,
    )
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    counters_before = _spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = _spec_counters(llm)
    del llm
    gc.collect()
    return RunResult(
        texts=[o.outputs[0].text for o in outputs],
        token_ids=[list(o.outputs[0].token_ids) for o in outputs],
        seconds=seconds,
        gaps=[top2_gaps(o) for o in outputs] if gaps else None,
        **{k: counters[k] - counters_before[k] for k in counters},
    )


def _agreement(args, prompts: list[str], plain: RunResult, tree: RunResult) -> str:
    """Whether DDTree's greedy outputs are no-spec's, and if not, where and
    why they part. The log-probabilities that tell a near-tie come from a
    second no-spec run, made only then (asking for them slows the timed
    run)."""
    from vllm_ddtree.greedy_ties import TIE, first_divergence

    if plain.token_ids == tree.token_ids:
        return "yes"
    plain = _run(args, prompts, None, gaps=True)
    assert plain.gaps is not None
    for i, (want, have, gaps) in enumerate(
        zip(plain.token_ids, tree.token_ids, plain.gaps, strict=True)
    ):
        d = first_divergence(want, have)
        if d is None:
            continue
        gap = gaps[d] if d < len(gaps) else float("nan")
        where = f"prompt {i}, token {d}: no-spec's top two log-probs {gap:.3f} apart"
        if gap < TIE:
            return f"up to a bf16 near-tie ({where}; either token is greedy)"
        return f"NO ({where}): please report it"
    return "yes"


def _spec_counters(llm) -> dict[str, int]:
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    counters = dict.fromkeys(names.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in names:
            counters[names[metric.name]] += int(metric.value)
    return counters


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="target model (default: bundled pair)")
    parser.add_argument("--drafter", help="DFlash drafter (default: bundled)")
    parser.add_argument(
        "--random-fixtures",
        action="store_true",
        help="use the random-weight test fixtures instead of the trained pair",
    )
    parser.add_argument("--budget", type=int, default=32, help="tree budget B")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="default 0.25 on CPU (it is the share of host memory there), 0.9 on GPU",
    )
    parser.add_argument("--prompt", action="append", help="repeatable")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--compare", action="store_true", help="also run without speculation"
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.gpu_memory_utilization is None:
        from vllm.platforms import current_platform

        args.gpu_memory_utilization = 0.25 if current_platform.is_cpu() else 0.9
    if (args.model is None) != (args.drafter is None):
        raise SystemExit("--model and --drafter go together")
    if args.model is None and args.random_fixtures:
        from vllm_ddtree.fixtures import fixture_paths

        paths = fixture_paths()
        args.model, args.drafter = str(paths.dense_target), str(paths.dense_drafter)
    elif args.model is None:
        from vllm_ddtree.fixtures import trained_pair

        pair = trained_pair()
        args.model, args.drafter = str(pair.target), str(pair.drafter)
    prompts = args.prompt or DEFAULT_PROMPTS

    spec = {
        "method": "ddtree",
        "model": args.drafter,
        "num_speculative_tokens": args.budget,
    }
    tree = _run(args, prompts, spec)
    for prompt, text in zip(prompts, tree.texts, strict=True):
        print(f"--- {prompt!r}\n{text}\n")

    from transformers import AutoConfig

    block_size = getattr(AutoConfig.from_pretrained(args.drafter), "block_size", None)
    rows = [
        ("block size", block_size),
        ("tree budget", args.budget),
        ("decode rounds", tree.drafts),
        ("mean acceptance length", f"{tree.mean_acceptance_length:.2f}"),
        ("tokens", tree.num_tokens),
        ("tok/s", f"{tree.num_tokens / tree.seconds:.1f}"),
    ]
    if args.compare:
        plain = _run(args, prompts, None)
        rows += [
            ("no-spec tok/s", f"{plain.num_tokens / plain.seconds:.1f}"),
            ("speedup vs no-spec", f"{plain.seconds / tree.seconds:.2f}x"),
        ]
        if args.temperature == 0:
            rows.append(
                ("identical to no-spec", _agreement(args, prompts, plain, tree))
            )
    width = max(len(name) for name, _ in rows)
    print("DDTree statistics")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()
