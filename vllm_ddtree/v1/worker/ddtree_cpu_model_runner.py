# SPDX-License-Identifier: Apache-2.0
"""DDTree on vLLM's V1 CPU model runner.

A module of its own because importing vLLM's CPU worker stack replaces
``torch.cuda.set_stream`` / ``Stream`` with no-op placeholders for the whole
process (``vllm/v1/worker/cpu/shm.py``); the GPU path must never import it.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin


class DDTreeCPUModelRunner(DDTreeModelRunnerMixin, CPUModelRunner):
    pass
