# SPDX-License-Identifier: Apache-2.0
"""The ``method: "ddtree"`` speculative config: parsing and validation.

Users write::

    --speculative-config '{"method": "ddtree", "model": "<DFlash drafter>",
                           "num_speculative_tokens": 64,
                           "ddtree": {"force_spine": false}}'

``num_speculative_tokens`` is the tree budget ``B`` (nodes per request, root
excluded). vLLM itself only knows ``"dflash"``; the plugin rewrites the method
to ``"dflash"`` (so every DFlash code path, drafter loading included, keeps
working) and carries the DDTree settings inside the drafter's
``dflash_config`` dict, which travels to the engine core and to every worker
with the rest of the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

METHOD = "ddtree"
# Key under ``draft_model_config.hf_config.dflash_config`` carrying the settings.
CONFIG_KEY = "ddtree"
# The DFlash block size of the released Qwen3 drafters (bonus + 15 masks).
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DDTreeConfig:
    """Settings of one DDTree engine.

    Attributes:
        budget: ``B``, tree nodes per request excluding the root (the user's
            ``num_speculative_tokens``).
        max_depth: deepest tree level; the drafter is asked for this many
            positions. Defaults to the drafter's ``block_size - 1``.
        force_spine: always keep the drafter's top-1 chain in the tree, which
            helps at small budgets where a best-first tree may drop it.
        adaptive_budget: each step, verify only the part of every tree that
            maximises expected tokens per second under a latency model of
            the target measured at startup (see ``adaptive_budget.py``);
            ``budget`` (and a request's own budget) stay the upper bounds.
            Off: every request verifies its full budget.
        flash_context: on NVIDIA GPUs, verify batches made only of full
            trees (the ones replayed as full CUDA graphs) with
            FlashAttention over the context plus a tree-only Triton pass,
            merged by log-sum-exp, instead of the one fused Triton kernel
            (faster in 10 of 12 kernel-level shapes on an H200; see
            ``flash_context_tree_attention.py``). Off by default: in the
            engine it has not been faster yet (docs/usage.md).
        model_runner: ``"v1"`` (default) runs DDTree on vLLM's V1 model
            runner; ``"v2"`` on the V2 runner (vLLM's default for dense
            models on GPUs), experimental: CUDA, dense 1-D RoPE targets and
            fixed budgets only (``docs/v2_port.md``).
        chain_from_batch_size: V2 runner only: at batch sizes of at least
            this, verify DFlash's own chain (the drafter's top token at each
            of ``chain_length`` positions) with vLLM's FlashAttention and
            rejection sampler instead of a tree: where a tree's extra tokens
            a step are worth less than its extra host work, the step costs
            what stock DFlash's does. ``None``: trees at every batch size.
    """

    budget: int
    max_depth: int
    force_spine: bool = False
    adaptive_budget: bool = True
    flash_context: bool = False
    model_runner: str = "v1"
    chain_from_batch_size: int | None = None

    @property
    def chain_length(self) -> int | None:
        """The draft length of a chain step (``None`` without chain steps):
        the drafter's positions, at most the budget (vLLM caps every
        scheduled draft length at ``num_speculative_tokens``)."""
        if self.chain_from_batch_size is None:
            return None
        return min(self.budget, self.max_depth)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_BOOL_KEYS = ("force_spine", "adaptive_budget", "flash_context")
_USER_KEYS = {*_BOOL_KEYS, "max_depth", "model_runner", "chain_from_batch_size"}
MODEL_RUNNERS = ("v1", "v2")
# Chain-speculation options that DDTree replaces: the value a user may leave
# (vLLM's default) and why any other value cannot be honoured.
_CHAIN_ONLY_OPTIONS = {
    "disable_padded_drafter_batch": (
        False,
        "the tree commit reorders the padded drafter batch",
    ),
    "rejection_sample_method": ("standard", "trees are verified by a tree walk"),
    "draft_sample_method": ("greedy", "trees are built from draft log-probs"),
    "synthetic_acceptance_rates": (None, "trees are verified by a tree walk"),
    "use_local_argmax_reduction": (False, "trees need the top-B tokens"),
}
# vLLM's batch-size schedule of draft lengths: for DDTree, the number of tree
# nodes each step verifies (the best-first tree's first K nodes are a tree).
_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def _fail(field: str, problem: str, fix: str) -> ValueError:
    return ValueError(
        f"speculative_config[{field!r}] {problem}. {fix} (method 'ddtree')."
    )


def parse_user_options(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate the user's ``speculative_config`` for DDTree and split it.

    Returns the dict to hand to vLLM (method rewritten to ``dflash``); the
    DDTree-only options are left in the returned dict under ``"ddtree"`` for
    :func:`finalize` to consume once the drafter's config is known.
    """
    spec = dict(spec)
    if not spec.get("model"):
        raise _fail(
            "model",
            "is missing",
            "Pass the path or name of a DFlash drafter "
            '(architectures ["DFlashDraftModel"])',
        )
    budget = spec.get("num_speculative_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise _fail(
            "num_speculative_tokens",
            f"must be a positive integer (the tree budget B), got {budget!r}",
            "Set it to the number of tree nodes per request, e.g. 64",
        )
    for key, (default, why) in _CHAIN_ONLY_OPTIONS.items():
        if key in spec and spec[key] != default:
            raise _fail(
                key,
                f"= {spec[key]!r} is not supported: {why}",
                f"Leave it out (default {default!r})",
            )
    options = spec.pop(CONFIG_KEY, None) or {}
    if not isinstance(options, dict):
        raise _fail(CONFIG_KEY, f"must be a dict, got {options!r}", "Use {...}")
    unknown = set(options) - _USER_KEYS
    if unknown:
        raise _fail(
            CONFIG_KEY,
            f"has unknown keys {sorted(unknown)}",
            f"Valid keys are {sorted(_USER_KEYS)}",
        )
    for key in _BOOL_KEYS:
        if key in options and not isinstance(options[key], bool):
            raise _fail(
                f"ddtree.{key}",
                f"must be true or false, got {options[key]!r}",
                "Use a JSON boolean",
            )
    if spec.get(_SCHEDULE_KEY) is not None and options.get("adaptive_budget", True):
        raise _fail(
            _SCHEDULE_KEY,
            "sizes the trees by batch size, which ddtree.adaptive_budget (on by "
            "default) also does, per step",
            'Set "ddtree": {"adaptive_budget": false} to use the schedule, or '
            "leave the schedule out",
        )
    runner = options.get("model_runner", "v1")
    if runner not in MODEL_RUNNERS:
        raise _fail(
            "ddtree.model_runner",
            f"must be one of {list(MODEL_RUNNERS)}, got {runner!r}",
            'Leave it out for vLLM\'s V1 runner, or use "v2"',
        )
    if runner == "v2" and options.get("adaptive_budget", True):
        raise _fail(
            "ddtree.model_runner",
            '= "v2" needs fixed budgets (the V2 runner never waits for the '
            "host, which chooses adaptive budgets each step)",
            'Add "adaptive_budget": false',
        )
    for key, fix in (
        ("max_depth", "Leave it out to use the drafter's block_size - 1"),
        ("chain_from_batch_size", "Leave it out to verify trees at every batch size"),
    ):
        value = options.get(key)
        if key in options and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise _fail(
                f"ddtree.{key}", f"must be a positive integer, got {value!r}", fix
            )
    if "chain_from_batch_size" in options and runner != "v2":
        raise _fail(
            "ddtree.chain_from_batch_size",
            "needs the V2 model runner (chain steps are a V2 runner feature)",
            'Add "model_runner": "v2", or leave chain_from_batch_size out',
        )
    spec["method"] = "dflash"
    spec[CONFIG_KEY] = options
    return spec


def check_drafter(model: str, revision: str | None = None) -> None:
    """Fail early, naming the field, if ``model`` is not a DFlash drafter.

    (Without this, vLLM's own error for a non-DFlash drafter under method
    ``dflash`` is a long list of supported architectures.)
    """
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(model, revision=revision)
    archs = list(config.get("architectures") or [])
    if "DFlashDraftModel" not in archs:
        raise _fail(
            "model",
            f"is not a DFlash drafter (architectures {archs})",
            'DDTree needs a drafter with architectures ["DFlashDraftModel"]',
        )


def finalize(speculative_config: Any, options: dict[str, Any]) -> DDTreeConfig:
    """Check the loaded drafter and attach the DDTree settings to it."""
    draft_hf = speculative_config.draft_model_config.hf_config
    dflash_config = getattr(draft_hf, "dflash_config", None)
    if not isinstance(dflash_config, dict):
        raise _fail(
            "model",
            "has no dflash_config in its config.json",
            "Use a DFlash drafter checkpoint (dflash_config with mask_token_id"
            " and target_layer_ids)",
        )
    _check_pair(speculative_config, dflash_config)
    block_size = int(getattr(draft_hf, "block_size", None) or DEFAULT_BLOCK_SIZE)
    max_depth = options.get("max_depth", block_size - 1)
    if max_depth > block_size - 1:
        raise _fail(
            "ddtree.max_depth",
            f"is {max_depth} but the drafter predicts only block_size - 1 = "
            f"{block_size - 1} positions",
            f"Use a value <= {block_size - 1}",
        )
    cfg = DDTreeConfig(
        budget=speculative_config.num_speculative_tokens,
        max_depth=max_depth,
        force_spine=options.get("force_spine", False),
        adaptive_budget=options.get("adaptive_budget", True),
        flash_context=options.get("flash_context", False),
        model_runner=options.get("model_runner", "v1"),
        chain_from_batch_size=options.get("chain_from_batch_size"),
    )
    if cfg.chain_length is not None:
        speculative_config.num_speculative_tokens_per_batch_size = with_chain_steps(
            speculative_config.num_speculative_tokens_per_batch_size, cfg
        )
    dflash_config[CONFIG_KEY] = cfg.to_dict()
    return cfg


# The last batch size of the chain steps' schedule entry: any bound past
# ``max_num_seqs`` (vLLM's lookup stops there).
_ANY_BATCH_SIZE = 1 << 20


def with_chain_steps(
    schedule: list[tuple[int, int, int]] | None, cfg: DDTreeConfig
) -> list[tuple[int, int, int]]:
    """vLLM's batch-size schedule of draft lengths (``None``: the budget at
    every batch size) with ``cfg.chain_length`` from
    ``cfg.chain_from_batch_size`` on: the scheduler then asks every request
    of such a batch for a chain's draft. Below it the schedule keeps its
    tree sizes, none of which may be the chain length: V2 captures one full
    CUDA graph per query length, and a chain's runs FlashAttention."""
    start, chain = cfg.chain_from_batch_size, cfg.chain_length
    assert start is not None and chain is not None
    trees = schedule or [(1, _ANY_BATCH_SIZE, cfg.budget)]
    below = [(lo, min(hi, start - 1), k) for lo, hi, k in trees if lo < start]
    for lo, hi, k in below:
        # (vLLM caps every length at the budget.)
        if min(k, cfg.budget) != chain:
            continue
        if schedule is None:
            raise _fail(
                "num_speculative_tokens",
                f"= {k} is the chain length min(budget, ddtree.max_depth), so "
                f"trees below batch size {start} (ddtree.chain_from_batch_size) "
                "would be as long as the chains above it; vLLM's V2 runner "
                "captures one CUDA graph per draft length",
                f"Use a budget above {cfg.max_depth}",
            )
        raise _fail(
            _SCHEDULE_KEY,
            f"gives trees of {k} nodes at batch sizes {lo}-{hi}, the length of "
            f"the chains verified from batch size {start} "
            "(ddtree.chain_from_batch_size); vLLM's V2 runner captures one CUDA "
            "graph per draft length",
            f"Use another tree size than {k} there",
        )
    return [*below, (start, max(start, _ANY_BATCH_SIZE), chain)]


def _check_pair(speculative_config: Any, dflash_config: dict[str, Any]) -> None:
    """The drafter must fit the target: DFlash reads the target's hidden
    states at ``target_layer_ids`` and uses the target's embedding and LM head,
    so hidden size and vocabulary must match and the layers must exist. The
    tree must also fit one request's KV: vLLM never allocates more than
    ``max_model_len`` slots per request, and a step needs the context (at
    least one token), the root and ``B`` nodes."""
    target = speculative_config.target_model_config
    draft = speculative_config.draft_model_config
    for what, target_value, draft_value in (
        ("hidden size", target.get_hidden_size(), draft.get_hidden_size()),
        ("vocab size", target.get_vocab_size(), draft.get_vocab_size()),
    ):
        if target_value != draft_value:
            raise _fail(
                "model",
                f"has {what} {draft_value} but the target {target.model} has "
                f"{target_value}",
                "Use the DFlash drafter trained for this target model",
            )
    num_layers = target.get_total_num_hidden_layers()
    layer_ids = dflash_config.get("target_layer_ids")
    if (
        not isinstance(layer_ids, list)
        or not layer_ids
        or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
            for i in layer_ids
        )
    ):
        raise _fail(
            "model",
            f"reads target layers dflash_config.target_layer_ids={layer_ids!r}, "
            f"but the target {target.model} has layers 0..{num_layers - 1}",
            "Use the DFlash drafter trained for this target model",
        )
    budget = speculative_config.num_speculative_tokens
    max_model_len = target.max_model_len
    if budget + 2 > max_model_len:
        raise _fail(
            "num_speculative_tokens",
            f"= {budget} needs {budget + 2} KV slots per request (context, "
            f"root and tree), more than max_model_len = {max_model_len} allows",
            f"Use at most {max_model_len - 2} or raise --max-model-len",
        )


def check_attention_backend(chosen: Any) -> None:
    """On CUDA DDTree brings its own tree backend (vLLM's ``CUSTOM`` slot); an
    explicitly chosen stock backend would verify the tree causally and
    silently produce wrong tokens, so it is refused. (The CPU platform ignores
    the choice and always runs ``CPU_ATTN``, which the plugin replaces.)"""
    name = getattr(chosen, "name", chosen)
    if name not in (None, "CUSTOM"):
        raise ValueError(
            f"attention_backend={name} cannot verify trees: method 'ddtree' "
            "runs its own FlashAttention-based tree backend. Remove "
            "--attention-backend / attention_config.backend."
        )


def get_ddtree_config_from_speculative(spec: Any) -> DDTreeConfig | None:
    """The DDTree settings of a ``SpeculativeConfig``, or None for other methods."""
    if spec is None or spec.method != "dflash" or spec.draft_model_config is None:
        return None
    dflash_config = getattr(spec.draft_model_config.hf_config, "dflash_config", None)
    if not isinstance(dflash_config, dict) or CONFIG_KEY not in dflash_config:
        return None
    return DDTreeConfig(**dflash_config[CONFIG_KEY])


def get_ddtree_config(vllm_config: Any) -> DDTreeConfig | None:
    """The DDTree settings of an engine config, or None for non-DDTree runs."""
    return get_ddtree_config_from_speculative(
        getattr(vllm_config, "speculative_config", None)
    )


# ``SamplingParams.extra_args`` key of the per-request budget override.
BUDGET_ARG = "ddtree_budget"


def validate_request(
    params: Any, cfg: DDTreeConfig, async_scheduling: bool = False
) -> None:
    """Reject a request whose sampling settings DDTree cannot honour.

    Called in the front-end, so a bad request fails alone (HTTP 400 from the
    server, ``ValueError`` from ``LLM.generate``) and the engine keeps
    serving. Penalties, bad words, min_tokens and logits processors condition
    on the tokens before each position, which differ per tree branch; the
    tree sampler does not implement them yet, and silently dropping them
    would change the output. Under async scheduling, and on the V2 runner,
    every tree has the engine's budget (see ``plugin._configure_scheduling``),
    so a request's own budget cannot be honoured either.
    """
    unsupported = []
    if params.presence_penalty or params.frequency_penalty:
        unsupported.append("presence_penalty / frequency_penalty")
    if params.repetition_penalty != 1.0:
        unsupported.append("repetition_penalty")
    if params.bad_words:
        unsupported.append("bad_words")
    if params.allowed_token_ids:
        unsupported.append("allowed_token_ids")
    if params.logit_bias:
        unsupported.append("logit_bias")
    if params.min_tokens:
        unsupported.append("min_tokens")
    if params.logprob_token_ids:
        unsupported.append("logprob_token_ids")
    if params.structured_outputs is not None:
        unsupported.append("structured outputs")
    if unsupported:
        raise ValueError(
            f"speculative method 'ddtree' does not support {', '.join(unsupported)}"
            " yet; remove them from the request or serve without ddtree."
        )
    budget = (params.extra_args or {}).get(BUDGET_ARG)
    if budget is not None and cfg.model_runner == "v2":
        raise ValueError(
            f"extra_args[{BUDGET_ARG!r}] is not supported on the V2 model runner "
            "(ddtree.model_runner 'v2'): every tree has the engine's "
            "num_speculative_tokens nodes. Remove it, or serve on the V1 runner."
        )
    if budget is not None and async_scheduling:
        raise ValueError(
            f"extra_args[{BUDGET_ARG!r}] needs synchronous scheduling: under "
            "async scheduling every tree has the engine's num_speculative_tokens "
            "nodes. Remove it, or serve with --no-async-scheduling."
        )
    if budget is not None and (
        isinstance(budget, bool)
        or not isinstance(budget, int)
        or not 0 <= budget <= cfg.budget
    ):
        raise ValueError(
            f"extra_args[{BUDGET_ARG!r}] must be an integer in [0, {cfg.budget}] "
            f"(the engine's num_speculative_tokens), got {budget!r}"
        )
