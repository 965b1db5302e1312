# SPDX-License-Identifier: Apache-2.0
"""The plugin is loaded through the entry point in every vLLM process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from vllm_ddtree import plugin

# The script reports through a file: its stdout is shared with the engine
# processes' DEBUG logs, which can interleave with a line being written.
SCRIPT = textwrap.dedent(
    """
    import json
    import os
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model={model!r}, dtype="bfloat16", max_model_len=128,
                  enforce_eager=True, gpu_memory_utilization=0.25,
                  speculative_config={spec!r})
        out = llm.generate({{"prompt_token_ids": [5, 6, 7]}},
                           SamplingParams(temperature=0, max_tokens=4))
        tokens = len(out[0].outputs[0].token_ids)
        with open({result!r}, "w") as fh:
            json.dump({{"parent": os.getpid(), "tokens": tokens}}, fh)
    """
)


def test_entry_point_is_declared():
    (ep,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name == "ddtree"
    ]
    assert ep.load() is plugin.register


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    wrapped = EngineArgs.create_speculative_config
    plugin.register()
    assert EngineArgs.create_speculative_config is wrapped


@pytest.mark.slow
def test_plugin_runs_in_engine_core_and_worker(fixtures, tmp_path):
    spec = {
        "method": "ddtree",
        "model": str(fixtures.dense_drafter),
        "num_speculative_tokens": 4,
    }
    script, result = tmp_path / "run.py", tmp_path / "result.json"
    script.write_text(
        SCRIPT.format(model=str(fixtures.dense_target), spec=spec, result=str(result))
    )
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_LOGGING_LEVEL="DEBUG",
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads(result.read_text())
    assert report["tokens"] == 4
    parent = report["parent"]
    pids = {
        int(p)
        for p in re.findall(r"vllm-ddtree plugin registered in process (\d+)", log)
    }
    # The front-end, the engine core and the worker each loaded it.
    assert parent in pids and len(pids) >= 3, pids


def test_gpu_worker_does_not_import_vllm_cpu_worker():
    """vLLM's CPU worker stack replaces ``torch.cuda.set_stream`` (and
    ``Stream``, ``synchronize``...) with no-ops at import; on a GPU that broke
    CUDA-graph capture ("CUDA graphs must be captured on a non-default
    stream"). The GPU worker and everything it imports must stay clear of it.
    """
    code = textwrap.dedent(
        """
        import sys
        import vllm_ddtree.plugin as plugin
        from vllm.utils.import_utils import resolve_obj_by_qualname
        resolve_obj_by_qualname(plugin._WORKERS["cuda"])
        bad = [m for m in sys.modules if m.startswith("vllm.v1.worker.cpu")]
        print("CPU MODULES:", bad)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "CPU MODULES: []" in out, out


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        # XD-RoPE positions live in rows the runner does not move to depths.
        (dict(uses_xdrope_dim=4, is_hybrid=False), NotImplementedError, "XD-RoPE"),
        # Hybrid targets whose recurrent layers are not Qwen Gated DeltaNet.
        (
            dict(
                uses_xdrope_dim=0,
                is_hybrid=True,
                architectures=["NemotronHForCausalLM"],
            ),
            NotImplementedError,
            "Qwen Gated DeltaNet",
        ),
        # The V2 runner port covers dense 1-D RoPE targets only.
        (
            dict(uses_xdrope_dim=0, is_hybrid=True, uses_mrope=False, v2=True),
            NotImplementedError,
            "model_runner 'v2'",
        ),
        (
            dict(uses_xdrope_dim=0, is_hybrid=False, uses_mrope=True, v2=True),
            NotImplementedError,
            "model_runner 'v2'",
        ),
    ],
)
def test_unsupported_targets_are_refused_by_name(target, error, match):
    from types import SimpleNamespace

    options = {"model_runner": "v2"} if target.pop("v2", False) else {}
    config = SimpleNamespace(model="some/model", **target)
    with pytest.raises(error, match=match):
        plugin._check_target(SimpleNamespace(mamba_cache_mode=None), config, options)


def test_v2_runner_needs_a_gpu(monkeypatch):
    """On a platform without CUDA (this CPU CI) ``model_runner: "v2"`` is
    refused by name, and the V2 runner is never switched on."""
    from types import SimpleNamespace

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with pytest.raises(ValueError, match="model_runner 'v2' needs a CUDA GPU"):
        plugin._configure_engine(
            SimpleNamespace(),
            SimpleNamespace(pipeline_parallel_size=1),
            {"model_runner": "v2"},
        )
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is None


def test_pipeline_parallelism_is_refused_by_name(monkeypatch):
    """Only the last pipeline stage knows the accepted path; the others
    could not commit their layers' KV. Refused before anything is set."""
    from types import SimpleNamespace

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with pytest.raises(ValueError, match="pipeline_parallel_size = 2"):
        plugin._configure_engine(
            SimpleNamespace(), SimpleNamespace(pipeline_parallel_size=2), {}
        )
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is None


@pytest.mark.parametrize(
    "arch",
    [
        "Qwen3NextForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    ],
)
def test_qwen_gdn_targets_are_accepted(arch):
    from types import SimpleNamespace

    config = SimpleNamespace(
        model="some/model", uses_xdrope_dim=0, is_hybrid=True, architectures=[arch]
    )
    plugin._check_target(
        SimpleNamespace(mamba_cache_mode=None, enable_prefix_caching=False),
        config,
        {},
    )
