# SPDX-License-Identifier: Apache-2.0
"""Workers that build the DDTree model runner.

vLLM's workers construct their runner by name inside ``init_device``; these
subclasses rebind that name to the DDTree runner for the duration of the
call, so nothing is built twice. The plugin selects them through
``parallel_config.worker_cls`` for ``method: "ddtree"`` only.
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker, gpu_model_runner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vllm_ddtree.v1.worker.ddtree_model_runner import (
    DDTreeCPUModelRunner,
    DDTreeGPUModelRunner,
    patched_attribute,
)


class DDTreeGPUWorker(Worker):
    def init_device(self) -> None:
        # DDTree is implemented on the V1 runner (see plugin.py).
        self.use_v2_model_runner = False
        with patched_attribute(
            gpu_model_runner, "GPUModelRunner", DDTreeGPUModelRunner
        ):
            super().init_device()


class DDTreeCPUWorker(CPUWorker):
    def init_device(self) -> None:
        self.use_v2_model_runner = False
        with patched_attribute(cpu_worker, "CPUModelRunner", DDTreeCPUModelRunner):
            super().init_device()
