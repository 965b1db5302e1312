"""DDTree tree speculative decoding for vLLM (out-of-tree plugin).

Importing this package has no side effects; vLLM calls
:func:`vllm_ddtree.plugin.register` through the ``vllm.general_plugins``
entry point in every process it starts.
"""

__version__ = "0.1.0"

from vllm_ddtree.v1.metrics.request_stats import DDTreeRequestStats, request_stats

__all__ = ["DDTreeRequestStats", "request_stats"]
