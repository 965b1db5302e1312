# SPDX-License-Identifier: Apache-2.0
"""The GPU worker that builds the DDTree model runner.

vLLM's workers construct their runner by name inside ``init_device``; this
subclass rebinds that name to the DDTree runner for the duration of the call,
so nothing is built twice. The plugin selects it through
``parallel_config.worker_cls`` for ``method: "ddtree"`` only. The CPU worker
lives in ``ddtree_cpu_worker`` (see ``ddtree_cpu_model_runner`` for why).
"""

from __future__ import annotations

from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_worker import Worker

from vllm_ddtree.v1.worker.ddtree_model_runner import (
    DDTreeGPUModelRunner,
    patched_attribute,
)
from vllm_ddtree.v1.worker.ddtree_worker_base import DDTreeWorkerMixin


class DDTreeGPUWorker(DDTreeWorkerMixin, Worker):
    def init_device(self) -> None:
        # DDTree is implemented on the V1 runner (see plugin.py).
        self.use_v2_model_runner = False
        with patched_attribute(
            gpu_model_runner, "GPUModelRunner", DDTreeGPUModelRunner
        ):
            super().init_device()
