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
   and pins the V1 model runner, the parts of the engine DDTree replaces.
   Upstream this would be a new method value.
2. ``SpeculativeConfig.max_num_new_slots_for_drafting`` is wrapped: for
   ``dflash`` it counts ``num_speculative_tokens - 1`` extra drafter queries
   per request, but a DDTree drafter runs ``max_depth`` queries whatever the
   budget, so a large budget would needlessly shrink (or zero) the token
   budget.
3. ``InputProcessor._validate_params`` (front-end process) is wrapped to
   reject, per request, the sampling features DDTree does not implement yet
   and bad ``extra_args["ddtree_budget"]`` values: the request fails alone
   (HTTP 400 / ``ValueError``) instead of the engine failing later.
4. ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)`` (CPU only): the
   CPU platform always uses ``CPU_ATTN`` whatever backend is selected, so
   tree attention on CPU has to take that name. The replacement subclasses
   the stock backend and behaves exactly like it unless the DDTree runner
   has published a tree for the current batch.
5. ``register_backend(AttentionBackendEnum.CUSTOM, ...)`` (CUDA only): the
   FlashAttention-based tree backend; hook 1 selects it for DDTree targets
   (vLLM's enum of backends is closed, ``CUSTOM`` is its extension point).
"""

from __future__ import annotations

import functools
import os
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
_WORKERS = {
    "cpu": "vllm_ddtree.v1.worker.ddtree_worker.DDTreeCPUWorker",
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

    if not getattr(EngineArgs.create_speculative_config, _WRAPPED, False):
        EngineArgs.create_speculative_config = _wrap_create_speculative_config(
            EngineArgs.create_speculative_config
        )
    slots = SpeculativeConfig.max_num_new_slots_for_drafting
    if not getattr(slots.fget, _WRAPPED, False):
        SpeculativeConfig.max_num_new_slots_for_drafting = property(
            _wrap_new_slots(slots.fget)
        )
    from vllm.v1.engine.input_processor import InputProcessor

    if not getattr(InputProcessor._validate_params, _WRAPPED, False):
        InputProcessor._validate_params = _wrap_validate_params(
            InputProcessor._validate_params
        )
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, _CPU_TREE_BACKEND)
    elif current_platform.is_cuda():
        register_backend(AttentionBackendEnum.CUSTOM, _GPU_TREE_BACKEND)
    logger.debug("vllm-ddtree plugin registered in process %d", os.getpid())


def _mark(fn: Any) -> Any:
    setattr(fn, _WRAPPED, True)
    return fn


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
        _check_target(target_model_config)
        _configure_engine(self, target_parallel_config)
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


def _check_target(target_model_config) -> None:
    if target_model_config.is_hybrid:
        raise NotImplementedError(
            f"method 'ddtree' does not support hybrid (Mamba / Gated DeltaNet) "
            f"target models yet ({target_model_config.model}): their recurrent "
            "state needs per-branch rollback under a tree. Use method 'dflash' "
            "for this model."
        )


def _configure_engine(engine_args, parallel_config) -> None:
    """Engine settings the DDTree V1 integration relies on."""
    from vllm.platforms import current_platform

    if engine_args.async_scheduling:
        raise ValueError(
            "async_scheduling=True is not supported with method 'ddtree' yet: "
            "the tree of step N+1 depends on step N's walk. Remove "
            "--async-scheduling."
        )
    engine_args.async_scheduling = False

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("0", ""):
        raise ValueError(
            "method 'ddtree' runs on the V1 model runner; unset "
            "VLLM_USE_V2_MODEL_RUNNER or set it to 0."
        )
    # Read lazily by vLLM in this process and inherited by the engine-core
    # and worker processes it starts afterwards.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

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


def _wrap_validate_params(original):
    @functools.wraps(original)
    def _validate_params(self, params, supported_tasks):
        original(self, params, supported_tasks)
        from vllm import SamplingParams

        from vllm_ddtree.config import (
            get_ddtree_config_from_speculative,
            validate_request,
        )

        cfg = get_ddtree_config_from_speculative(self.speculative_config)
        if cfg is not None and isinstance(params, SamplingParams):
            validate_request(params, cfg)

    return _mark(_validate_params)
