#!/usr/bin/env bash
# Everything we check on the H200, in as few device calls as possible.
#
# On the device machine, after staging vLLM there (../shared/device/README.md):
#   bash scripts/h200_check.sh tests   # kernels + engines (~6 min)
#   bash scripts/h200_check.sh bench   # benchmarks (~8 min)
# Every engine runs in a process of its own (in-process engines neither free
# GPU memory nor reset vLLM's CUDA-graph state). Full logs are packed into
# $OUT/logs.tgz (the device returns at most 8 files), a summary goes to
# stdout and $OUT/summary.txt, benchmark JSON to $OUT.
set -u
mode=${1:?usage: h200_check.sh tests|bench}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source /tmp/site/env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=${OUT:-$PWD/h200-results}
logs=$(mktemp -d)
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1

# step NAME SECONDS CMD...: run with a time limit (GNU timeout signals its whole
# process group, so a timed-out engine does not leave its EngineCore behind).
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  pkill -9 -f "EngineCor[e]" 2>/dev/null
  local tail
  tail=$(grep -E "[0-9]+ (passed|failed)|Error|error:" "$logs/$name.log" | tail -1)
  printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - start)) "$tail" |
    tee -a "$out/summary.txt"
}

engine_test() {  # one pytest id of an engine test file, alone in its process
  step "$1" "$2" python3 -m pytest -q -rA "$3" -k "$4"
}

case $mode in
tests)
  step kernels 240 python3 -m pytest -q tests/gpu/test_tree_attention_gpu.py \
    tests/gpu/test_tree_gdn_gpu.py
  for id in True-16-8 True-32-64 False-16-8 False-16-64 stock_dflash; do
    engine_test "engine-$id" 150 tests/gpu/test_ddtree_engine_gpu.py "$id"
  done
  step hybrid-engine 300 python3 -m pytest -q -rA tests/gpu/test_ddtree_hybrid_gpu.py
  ;;
bench)
  step tree-attention 300 python3 benchmarks/bench_tree_attention.py \
    --out "$out/tree_attention.json"
  step hybrid-verify 150 python3 benchmarks/bench_hybrid_verify.py \
    --out "$out/hybrid_verify.json"
  ;;
*)
  echo "unknown mode $mode" >&2
  exit 2
  ;;
esac
tar czf "$out/logs-$mode.tgz" -C "$logs" .
