#!/usr/bin/env bash
# DDTree with tensor parallelism on two GPUs (issue 9): greedy DDTree == no-spec
# and tok/s vs stock DFlash, on a dummy-weight Qwen3-8B and on the hybrid
# (Gated DeltaNet) fixture. Needs a 2-GPU machine (device kind nvidia-h200-x2)
# with vLLM staged (../shared/device/README.md). Results: $OUT (or ./tp2-results).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f /tmp/site/env.sh ] && source /tmp/site/env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:-$PWD/tp2-results}
mkdir -p "$out"
python3 -m vllm_ddtree.fixtures >/dev/null || exit 1
python3 benchmarks/tp2_check.py --out "$out/tp2-qwen3-8b.json"
dense=$?
python3 benchmarks/tp2_check.py --target .fixtures/hybrid-target \
  --drafter .fixtures/hybrid-dflash --load-format auto --out "$out/tp2-hybrid.json"
hybrid=$?
echo "dense rc=$dense hybrid rc=$hybrid"
exit $((dense || hybrid))
