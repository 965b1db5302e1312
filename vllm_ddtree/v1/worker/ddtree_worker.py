# SPDX-License-Identifier: Apache-2.0
"""The GPU worker that builds the DDTree model runner.

vLLM's workers construct their runner by name inside ``init_device``; this
subclass rebinds that name to the DDTree runner for the duration of the call,
so nothing is built twice: the V1 runner's, or with ``ddtree.model_runner:
"v2"`` the V2 runner's. The plugin selects it through
``parallel_config.worker_cls`` for ``method: "ddtree"`` only. The CPU worker
lives in ``ddtree_cpu_worker`` (see ``ddtree_cpu_model_runner`` for why).
"""

from __future__ import annotations

from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_worker import Worker

from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.v1.worker.ddtree_model_runner import (
    DDTreeGPUModelRunner,
    patched_attribute,
)
from vllm_ddtree.v1.worker.ddtree_worker_base import DDTreeWorkerMixin


class DDTreeGPUWorker(DDTreeWorkerMixin, Worker):
    def init_device(self) -> None:
        cfg = get_ddtree_config(self.vllm_config)
        if cfg is not None and cfg.model_runner == "v2":
            # Imported here: V1 engines need none of the V2 runner.
            from vllm.v1.worker.gpu import model_runner as v2_model_runner

            from vllm_ddtree.v1.worker.gpu.model_runner import DDTreeV2ModelRunner

            self.use_v2_model_runner = True
            owner, runner = v2_model_runner, DDTreeV2ModelRunner
        else:
            self.use_v2_model_runner = False
            owner, runner = gpu_model_runner, DDTreeGPUModelRunner
        with patched_attribute(owner, "GPUModelRunner", runner):
            super().init_device()
