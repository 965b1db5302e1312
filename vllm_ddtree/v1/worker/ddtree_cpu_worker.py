# SPDX-License-Identifier: Apache-2.0
"""The CPU worker that builds the DDTree model runner (see ``ddtree_worker``)."""

from __future__ import annotations

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_ddtree.v1.worker.ddtree_cpu_model_runner import DDTreeCPUModelRunner
from vllm_ddtree.v1.worker.ddtree_model_runner import patched_attribute
from vllm_ddtree.v1.worker.ddtree_worker_base import DDTreeWorkerMixin


class DDTreeCPUWorker(DDTreeWorkerMixin, CPUWorker):
    def init_device(self) -> None:
        self.use_v2_model_runner = False
        with patched_attribute(cpu_worker, "CPUModelRunner", DDTreeCPUModelRunner):
            super().init_device()
