#!/usr/bin/env bash
# Everything we check on the H200, in as few device calls as possible.
#
# On the device machine, after staging vLLM there (../shared/device/README.md):
#   bash scripts/h200_check.sh tests   # kernel tests: attention, GDN, cores (~5 min)
#   bash scripts/h200_check.sh engines # dense engines, greedy == no-spec (~9 min)
#   bash scripts/h200_check.sh async   # async scheduling: greedy engine, no host syncs (~4 min)
#   bash scripts/h200_check.sh graphs  # full CUDA graphs: kernel under capture, graph engines,
#                                      # flash_context and adaptive-vs-full-graph engines (~8 min)
#   bash scripts/h200_check.sh sampling # GPU tree sampler; seeded DDTree == seeded V2 no-spec (~4 min)
#   bash scripts/h200_check.sh serve   # stock DFlash beside the plugin, trees beside (1 + B)-token
#                                      # prompts, OpenAI server (~7 min)
#   bash scripts/h200_check.sh soak    # 6-minute soak: 32 clients, DDTree vs no-spec servers (~10 min)
#   bash scripts/h200_check.sh soak-start  # the 10-minute soak, detached: it outlives this call
#                                          # while the machine stays warm; run other modes meanwhile
#   bash scripts/h200_check.sh soak-finish # wait for it (SOAK_WAIT seconds at most), collect results
#   bash scripts/h200_check.sh engine NAME SECONDS FILE K  # one engine test (pytest -k K)
#   bash scripts/h200_check.sh pending # what changed since the last GPU run: the verify-step
#                                      # kernels on lean layouts, V2 greedy with CUDA graphs
#                                      # (covered batches plan no FlashAttention), V2 requests
#                                      # entering mid-run (chain rows, block table) (~9 min)
#   bash scripts/h200_check.sh hybrid  # hybrid engines: greedy eager / CUDA graphs, prefix caching (~9.7 min)
#   bash scripts/h200_check.sh kernels # tree-attention + hybrid verify kernel benchmarks (~6 min)
#   bash scripts/h200_check.sh verify-costs # GDN kernel tests, the GDN share of a
#                                      # verify step (~6 min)
#   bash scripts/h200_check.sh sweep   # tree-attention tiles x splits, tree-pass tiles, at engine shapes, + FA3 (~4 min)
#   bash scripts/h200_check.sh cores   # tree cores: GPU test (== torch cores), device times (~4 min)
#   bash scripts/h200_check.sh shapes  # tree attention at the engine's shapes (chosen tiles), + FA3 (~2 min)
#   bash scripts/h200_check.sh caches  # pack the compile / autotune caches into $OUT (see below)
#   bash scripts/h200_check.sh e2e-8b  # dummy Qwen3-8B step cost: no-spec / DFlash / DDTree (~8 min)
#   bash scripts/h200_check.sh e2e-8b-flash  # + DDTree with ddtree.flash_context, same table (~4 min)
#   bash scripts/h200_check.sh e2e-8b-v1  # + no-spec and DFlash on the V1 runner, same table (~5 min)
#   bash scripts/h200_check.sh e2e-8b-async  # no-spec / DFlash / DDTree, all async-scheduled (~8 min;
#                                          # E2E_BATCHES=1 for batch 1 only)
#   bash scripts/h200_check.sh e2e-8b-async-flash  # + DDTree with ddtree.flash_context, same table (~4 min)
#   bash scripts/h200_check.sh e2e-8b-async-v2  # no-spec / DFlash / DDTree on the V2 runner
#                                          # (ddtree.model_runner "v2"), same table (~8 min;
#                                          # E2E_METHODS picks the methods; E2E_SCHEDULE,
#                                          # e.g. 1-1:64,2-1024:15, sizes DDTree's trees
#                                          # by batch size: rows "64 by batch")
#   bash scripts/h200_check.sh e2e-hybrid  # dummy Qwen3.5-9B-like hybrid: no-spec / DFlash / DDTree (~9 min;
#                                        # E2E_BATCHES=1 for batch 1 only)
#   bash scripts/h200_check.sh e2e-qwen35  # the same on dummy Qwen3.5-9B (M-RoPE, served
#                                        # language-model only) (~9 min; E2E_BATCHES=1 for batch 1)
#   bash scripts/h200_check.sh e2e-30b  # the same on dummy Qwen3-30B-A3B (MoE) (~9 min)
#   bash scripts/h200_check.sh profile # DDTree B=64 and DFlash (V1) steps of dummy Qwen3-8B profiled (~9 min)
#   bash scripts/h200_check.sh profile-pair  # the trained pair's steps profiled, all on the V2
#                                          # runner, async: DDTree B=64 and DFlash (PROFILE_METHODS,
#                                          # PROFILE_BATCH, PROFILE_BUDGET: DDTree's B,
#                                          # default 64; PROFILE_SCHEDULE: its trees by
#                                          # batch size, as E2E_SCHEDULE (e.g. B = 64 at
#                                          # batch 64 with 1-8:64,9-32:32,33-1024:16:
#                                          # 16-node trees, prompts of up to 65 tokens
#                                          # as chain rows; B = 16 has the same trees
#                                          # and no chain rows for 64-token prompts);
#                                          # PROFILE_TAG names the run's
#                                          # logs and results; PROFILE_CAPTURE: vLLM's largest
#                                          # CUDA graph, for batches of more than 512
#                                          # tokens; PROFILE_TEMPERATURE; PROFILE_STEADY=N:
#                                          # N requests kept PROFILE_BATCH in flight, the
#                                          # mixed steps timed apart); trains a
#                                          # 3-minute pair first if
#                                          # /tmp/pair-h200 has none (then one profile fits
#                                          # the call, the rest are skipped: call again), ~6 min
#   bash scripts/h200_check.sh train   # the h200 trained pair into /tmp/pair-h200
#                                      # (TRAIN_MINUTES, default 8; ~9 min)
#   bash scripts/h200_check.sh train-e2e  # a 3-minute pair (TRAIN_MINUTES), then the
#                                         # no-spec and DFlash rows on it (~10 min)
#   bash scripts/h200_check.sh e2e     # + DDTree B=16 and B=64 rows, same table (~8 min)
#   bash scripts/h200_check.sh e2e-more  # + DDTree B=256, DFlash on the V1 runner, and the
#                                        # parity check against the reference (~9 min)
#   bash scripts/h200_check.sh e2e-async  # no-spec / DFlash / DDTree B=64 on the pair, all
#                                         # async-scheduled, a table of its own (~9 min)
#   bash scripts/h200_check.sh e2e-async-v2  # + DDTree B=64 on the V2 runner, same table
#                                            # (E2E_SCHEDULE: trees sized by batch size)
#   bash scripts/h200_check.sh train-e2e-async-v2  # a 3-minute pair and all three
#                                            # async rows in one call (E2E_BATCH_SIZES;
#                                            # E2E_METHODS, E2E_BUDGETS: DDTree's Bs, default 64;
#                                            # E2E_STEADY=1: requests kept in flight, not waves)
# (train and e2e, e2e-8b and its -flash / -v1 additions run back to back: /tmp survives
# only while the machine stays warm.)
# Every engine runs in a process of its own (in-process engines neither free
# GPU memory nor reset vLLM's CUDA-graph state). Full logs are packed into
# $OUT/logs-MODE.tgz (engine: logs-engine-NAME.tgz; the device returns at
# most 8 files), a summary goes to
# stdout and $OUT/summary.txt, benchmark JSON to $OUT.
set -u
mode=${1:?usage: h200_check.sh tests|engines|engine|pending|async|graphs|sampling|serve|soak|soak-start|soak-finish|hybrid|kernels|cores|verify-costs|sweep|shapes|caches|e2e-8b|e2e-8b-flash|e2e-8b-v1|e2e-8b-async|e2e-8b-async-flash|e2e-8b-async-v2|e2e-hybrid|e2e-qwen35|e2e-30b|profile|profile-pair|train|train-e2e|train-e2e-async-v2|e2e|e2e-more|e2e-async|e2e-async-v2}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source /tmp/site/env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Compiled Triton kernels, Triton's autotuning timings, FlashInfer's JIT
# builds and vLLM's compile cache outlive the machine: `caches` packs them
# into $OUT as parts of at most 15 MiB (NAME.tgz.part-NN); for the next
# machine (a lost or idle-released one is bare), put those files in
# .device-cache/ (git-excluded) and carry them, a part or two beside each
# staging part (a call carries 64 MiB); carried files stay for the next call
# on the same machine, and the first call that finds all parts of a cache
# unpacks it before anything compiles (the FLA kernels' autotuning alone
# takes ~200 s, the first engine's warm-up on a fresh machine ~100 s).
export TRITON_CACHE_AUTOTUNING=1
for first in .device-cache/*.part-00; do
  [ -f "$first" ] || continue
  name=${first%.part-00}
  [ -f "$HOME/.unpacked-${name##*/}" ] && continue
  cat "$name".part-* | tar xzf - -C "$HOME" && touch "$HOME/.unpacked-${name##*/}" ||
    echo "could not unpack $name (a part missing?)"
done
# Wheels the staged bundle lacks: truststore, which the openai client's
# httpx2 imports (the soak's clients died on it, 2026-12-03). Put them in
# .device-extra/ (git-excluded; `pip download truststore==0.10.5 --no-deps
# -d .device-extra`) and carry it.
if compgen -G ".device-extra/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/site .device-extra/*.whl ||
    echo "could not install .device-extra"
fi
out=${OUT:-$PWD/h200-results}
logs=$(mktemp -d)
# Named by mode, and engine runs by test name too: two runs in one device
# call would otherwise pack over each other's logs.
pack="$out/logs-$mode.tgz"
[ "$mode" = engine ] && pack="$out/logs-engine-$2.tgz"
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
  # Only this call's session: the detached soak's servers (setsid) keep theirs.
  pkill -9 -s 0 -f "EngineCor[e]" 2>/dev/null
  local tail
  tail=$(grep -E "[0-9]+ (passed|failed)|Error|error:" "$logs/$name.log" | tail -1)
  printf '%-28s rc=%-3s %4ss  %s\n' "$name" "$rc" $((SECONDS - start)) "$tail" |
    tee -a "$out/summary.txt"
  grep -E "^(FAILED|ERROR) " "$logs/$name.log" | tee -a "$out/summary.txt"
  # Kernels vLLM's JIT monitor saw compile while an engine served (a
  # latency spike inside whatever the step timed): name them next to the
  # step. The monitor stays armed once a process's first engine has warmed
  # up, so a second engine's start-up compiles are logged the same way:
  # only lines between an engine's "init engine ... took" and the next
  # engine's start count, and only vLLM's own timestamped lines (pytest
  # repeats the captured log under another format).
  local jit
  jit=$(awk '
    /[A-Z]+ [0-9-]+ [0-9:]+ \[core\.py:[0-9]+\] Initializing a V1 LLM engine/ { serving = 0 }
    /[A-Z]+ [0-9-]+ [0-9:]+ \[core\.py:[0-9]+\] init engine .* took/ { serving = 1 }
    serving && match($0, /WARNING [0-9-]+ [0-9:]+ \[jit_monitor\.py:[0-9]+\] Triton kernel JIT compilation during inference: [A-Za-z0-9_]+/) {
      line = substr($0, RSTART, RLENGTH); sub(/.*: /, "", line); print line
    }' "$logs/$name.log" | sort | uniq -c | awk '{printf "%s%s x%s", sep, $2, $1; sep=", "}')
  [ -n "$jit" ] && echo "  compiled mid-serving: $jit" | tee -a "$out/summary.txt"
  # Pack the logs after every step: a call cut at the device's time limit
  # still brings back everything that ran.
  tar czf "$pack" -C "$logs" .
}

# Engine tests run with -s: pytest's capture would hold the engine's log
# until the test ends, and a test cut by its time limit would leave none.
engine_test() {  # one pytest id of an engine test file, alone in its process
  step "$1" "$2" python3 -m pytest -q -s -rA "$3" -k "$4"
}

kernel_tests() {
  step kernels 400 python3 -m pytest -q -rf --durations=15 \
    tests/gpu/test_tree_attention_gpu.py tests/gpu/test_tree_gdn_gpu.py \
    tests/gpu/test_tree_cores_gpu.py
}

profile_8b() {  # DDTree B=64, then stock DFlash on the same (V1) runner, profiled
  # PROFILE_ASYNC=1: both under async scheduling.
  local common=(--target benchmarks/configs/qwen3-8b
    --drafter benchmarks/configs/qwen3-8b-dflash ${PROFILE_ASYNC:+--async-scheduling})
  step profile-8b 330 python3 benchmarks/profile_ddtree_step.py --out /tmp/prof-8b/ddtree \
    "${common[@]}" --budget 64
  VLLM_USE_V2_MODEL_RUNNER=0 step profile-8b-dflash-v1 220 python3 \
    benchmarks/profile_ddtree_step.py --out /tmp/prof-8b/dflash-v1 "${common[@]}" \
    --method dflash
  tar czf "$out/profile-8b.tgz" -C /tmp prof-8b
}

profile_pair() {  # the pair's DDTree (V2 runner) and DFlash steps, async, profiled
  [ -f /tmp/pair-h200/target/config.json ] || train_pair "${TRAIN_MINUTES:-3}" 250
  local method tag=${PROFILE_TAG:+-$PROFILE_TAG}
  for method in ${PROFILE_METHODS:-ddtree dflash}; do
    # A call has 600 s: a profile that cannot finish is left for the next.
    if ((SECONDS + 200 > 590)); then
      echo "profile-pair-$method: skipped, no time left (PROFILE_METHODS=$method next)" |
        tee -a "$out/summary.txt"
      continue
    fi
    step "profile-pair-$method$tag" 200 python3 benchmarks/profile_ddtree_step.py \
      --pair /tmp/pair-h200 --method "$method" --runner v2 --budget "${PROFILE_BUDGET:-64}" \
      --batch "${PROFILE_BATCH:-1}" --prompt-len 64 --max-tokens 128 --async-scheduling \
      --temperature "${PROFILE_TEMPERATURE:-0}" \
      ${PROFILE_STEADY:+--steady-requests "$PROFILE_STEADY"} \
      ${PROFILE_CAPTURE:+--max-cudagraph-capture-size "$PROFILE_CAPTURE"} \
      ${PROFILE_SCHEDULE:+--schedule "$PROFILE_SCHEDULE"} \
      ${PROFILE_CHAIN_FROM:+--chain-from "$PROFILE_CHAIN_FROM"} \
      --out "/tmp/prof-pair/$method$tag"
  done
  tar czf "$out/profile-pair.tgz" -C /tmp prof-pair
}

e2e_report() {  # NAME: rebuild /tmp/NAME's table from its finished engines into $OUT
  python3 benchmarks/bench_e2e.py --out "/tmp/$1" --report-only >/dev/null
  cp "/tmp/$1/results.json" "$out/$1.json"
  cp "/tmp/$1/table.md" "$out/$1.md"
  # Adaptive DDTree rows' tree sizes per batch size, as a batch-size schedule.
  if [ -f "/tmp/$1/schedules.json" ]; then cp "/tmp/$1/schedules.json" "$out/$1-schedules.json"; fi
}

# TABLE CONFIG [ARGS...]: no-spec / DFlash / DDTree B=64 (fixed) step costs of
# benchmarks/configs/CONFIG with dummy weights, into $OUT/TABLE.{json,md}.
# E2E_LIMIT: seconds for the whole table (when it shares a call); the engines
# that finished are reported either way. E2E_BATCHES=1 for batch 1 only;
# E2E_METHODS narrows the rows (a fresh machine's hybrid engines take ~90 s
# each to start, so three of them barely fit one call); E2E_CAPTURE caps the
# CUDA-graph sizes (72 holds a batch-1 tree of 65: fewer graphs to capture);
# E2E_ROUNDS as in e2e_pair (all engines alive: each a third of the memory).
e2e_dummy() {
  step "$1" "${E2E_LIMIT:-590}" python3 benchmarks/bench_e2e.py --out "/tmp/$1" \
    --target "benchmarks/configs/$2" --drafter "benchmarks/configs/$2-dflash" \
    --load-format dummy --methods "${E2E_METHODS:-nospec,dflash,ddtree}" --budgets 64 --fixed-budget \
    --batch-sizes "${E2E_BATCHES:-1,16}" --temperatures 0 --prompt-len 768 \
    --max-tokens 64 --job-timeout $((300 * ${E2E_ROUNDS:-1})) ${E2E_ROUNDS:+--rounds "$E2E_ROUNDS"} \
    ${E2E_CAPTURE:+--max-cudagraph-capture-size "$E2E_CAPTURE"} "${@:3}"
  e2e_report "$1"
}

train_pair() {  # MINUTES LIMIT: the h200 preset into /tmp/pair-h200
  step train "$2" python3 -m vllm_ddtree.training.train_pair --preset h200 \
    --max-minutes "$1" --out /tmp/pair-h200
  cp /tmp/pair-h200/training.json "$out/"
  # The time limit includes the tokenizer and the token stream, host work:
  # on a slow host (2026-12-07, an H100 whose host ran 2x slower) a 2-minute
  # run left the target 68 steps and the drafter tau 1.3 (10.1 the session
  # before). Say what the pair is, and when it is too weak for a table.
  python3 - /tmp/pair-h200/training.json <<'PY' | tee -a "$out/summary.txt"
import json, sys
report = json.load(open(sys.argv[1]))
tau = report["heldout_greedy"]["tau"]
steps = "; ".join(
    f"{part} {report[part]['steps']}/{report[part]['planned_steps']} steps"
    for part in ("target", "drafter")
)
weak = "  WEAK PAIR: train longer (TRAIN_MINUTES)" if tau < 4 else ""
print(f"  pair: {steps}; held-out greedy tau {tau:.2f}{weak}")
PY
}

# LIMIT TABLE METHODS BUDGETS [ARGS...]: engines on that pair into /tmp/TABLE,
# one table ($OUT/TABLE.{json,md}) that grows over the calls. Every call sizes
# the engines for the grid's widest tree (E2E_SIZE), so the rows of all calls
# share one set of engine settings and their ratios compare like with like.
# E2E_ROUNDS=N: the engines alive together, taking turns N times per row,
# ratios paired by round (the pair's steps are host-bound, the device busy
# ~1 ms of 3.6-5.2, and DFlash's batch-16 greedy row ranged 7,767-15,987
# tok/s over five runs on one H100, 2026-12-07). E2E_KV_GIB=G: a G-GiB KV
# cache per engine, so that the engines start at once (one after the other,
# a fresh machine's first two took ~350 s, 2026-12-07).
# CUDA graphs up to E2E_CAPTURE tokens (64 trees of 65 nodes; vLLM's default
# of 512 left DDTree's batch-16 and batch-64 steps, and DFlash's at batch 64,
# without graphs in the first run, 2026-12-04).
e2e_pair() {
  step "$2-${3//,/+}-${4//,/+}" "$1" python3 benchmarks/bench_e2e.py --pair /tmp/pair-h200 \
    --out "/tmp/$2" --methods "$3" --budgets "$4" --batch-sizes "${E2E_BATCH_SIZES:-1,16,64}" \
    --size-for-budget "${E2E_SIZE:-256}" --max-cudagraph-capture-size "${E2E_CAPTURE:-4160}" \
    --temperatures 0,1 --job-timeout $((240 * ${E2E_ROUNDS:-1})) ${E2E_STEADY:+--steady} \
    ${E2E_KV_GIB:+--kv-cache-gib "$E2E_KV_GIB"} \
    ${E2E_ROUNDS:+--rounds "$E2E_ROUNDS"} "${@:5}"
  e2e_report "$2"
  cp "/tmp/$2"/*.png "$out/" 2>/dev/null
}

# The soak's load on the fixture models (a random drafter: the load, not
# acceptance, is the point), shared by the soak modes. A fixed KV cache per
# server lets both start at once (sized from free memory, they must start
# one after the other: about 7 minutes on a fresh machine, 2026-12-04).
soak_load=(python3 benchmarks/soak.py --fixtures --budget 16 --concurrency 32
  --warmup-seconds 30 --max-model-len 256 --max-tokens 32 --kv-cache-gib 2
  --server-arg=--max-num-seqs=64)

case $mode in
tests)
  kernel_tests
  ;;
engines)
  # The first engine of a fresh machine also pays vLLM's kernel JIT.
  engine_test engine-False-16-8-async 220 tests/gpu/test_ddtree_engine_gpu.py \
    False-16-8-async
  for id in True-16-8-async True-32-64-async False-16-64-async True-16-8-sync \
    False-16-64-sync; do
    engine_test "engine-$id" 110 tests/gpu/test_ddtree_engine_gpu.py "$id"
  done
  ;;
async)
  # Async scheduling: greedy == no-spec with CUDA graphs, and DDTree's own
  # step parts under torch's sync debug mode.
  engine_test engine-False-16-64-async 220 tests/gpu/test_ddtree_engine_gpu.py \
    False-16-64-async
  engine_test engine-async-no-sync 110 tests/gpu/test_ddtree_engine_gpu.py \
    never_wait
  ;;
graphs)
  step graph-kernels 120 python3 -m pytest -q -rf tests/gpu/test_tree_attention_gpu.py \
    -k "cuda_graph"
  engine_test engine-False-16-8-async 220 tests/gpu/test_ddtree_engine_gpu.py \
    False-16-8-async
  engine_test engine-False-16-64-sync 110 tests/gpu/test_ddtree_engine_gpu.py \
    False-16-64-sync
  engine_test engine-small_max_num_seqs 110 tests/gpu/test_ddtree_engine_gpu.py \
    small_max_num_seqs
  engine_test engine-flash_context 150 tests/gpu/test_ddtree_engine_gpu.py flash_context
  engine_test engine-adaptive 150 tests/gpu/test_ddtree_engine_gpu.py full_graphs
  ;;
sampling)
  step sampler 120 python3 -m pytest -q -rf tests/test_keyed_gumbel.py
  engine_test engine-seeded 300 tests/gpu/test_ddtree_engine_gpu.py seeded
  ;;
serve)
  engine_test engine-stock_dflash 150 tests/gpu/test_ddtree_engine_gpu.py stock_dflash
  engine_test engine-prompts-of-tree-size 180 tests/gpu/test_ddtree_engine_gpu.py \
    prompts_of_tree_size
  step serve 240 python3 -m pytest -q -rA tests/gpu/test_serve_gpu.py
  ;;
soak)
  # A device call lasts 10 minutes, so the load runs for 6.
  step soak 580 "${soak_load[@]}" --minutes 6 \
    --server-arg=--gpu-memory-utilization=0.3 --log-dir "$logs/soak-servers" \
    --out "$out/soak-h200.json"
  ;;
soak-start)
  # A device call lasts 10 minutes at most, so the 10-minute soak runs
  # detached (setsid: not in this call's process group) in /tmp, which
  # survives while the machine stays warm; correctness modes can share the
  # GPU with it meanwhile (the soak's servers take 2 x 0.2 of its memory).
  rm -rf /tmp/soak-bg && mkdir -p /tmp/soak-bg
  setsid nohup "${soak_load[@]}" --minutes 10 \
    --server-arg=--gpu-memory-utilization=0.2 --log-dir /tmp/soak-bg/servers \
    --out /tmp/soak-bg/soak-h200.json >/tmp/soak-bg/soak.log 2>&1 </dev/null &
  echo $! >/tmp/soak-bg/pid
  # Return (and let other modes use the GPU) once both servers are up. Only
  # modes with a steady, small memory footprint may share the GPU with the
  # soak: a server died during the 2026-12-03 soak while train_pair ran
  # beside it.
  up=0
  for _ in $(seq 100); do
    up=$(cat /tmp/soak-bg/servers/*.log 2>/dev/null | grep -c 'Application startup complete')
    [ "$up" -ge 2 ] && break
    sleep 5
  done
  echo "soak started (pid $(cat /tmp/soak-bg/pid)), $up of 2 servers up after ${SECONDS}s" |
    tee -a "$out/summary.txt"
  ;;
soak-finish)
  pid=$(cat /tmp/soak-bg/pid 2>/dev/null) || { echo "no soak was started"; exit 1; }
  waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "${SOAK_WAIT:-560}" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "soak still running after ${waited}s" | tee -a "$out/summary.txt"
  fi
  tail -40 /tmp/soak-bg/soak.log | tee -a "$out/summary.txt"
  cp /tmp/soak-bg/soak-h200.json "$out/" 2>/dev/null
  tar czf "$out/soak-logs.tgz" -C /tmp/soak-bg .
  ;;
engine)
  # One engine test alone: h200_check.sh engine NAME SECONDS FILE PYTEST_K
  engine_test "$2" "$3" "$4" "$5"
  ;;
pending)
  # The thirty-seventh session's CPU-tested changes: chain steps
  # (ddtree.chain_from_batch_size) against V2 no-spec, and the tree steps
  # beside them (the walk sampler's rows now sized as V2 sizes a chain's).
  # The first engine of a fresh machine also pays vLLM's kernel JIT.
  engine_test v2-chain-steps 300 tests/gpu/test_ddtree_v2_gpu.py "chain_steps and not dflash"
  engine_test v2-chain-dflash 150 tests/gpu/test_ddtree_v2_gpu.py chain_steps_are_dflash
  engine_test v2-schedule 150 tests/gpu/test_ddtree_v2_gpu.py batch_size_schedule
  ;;
hybrid)
  # One no-spec reference per mode, then a DDTree engine per budget; the
  # first engine of a fresh machine spends minutes tuning the FLA kernels.
  engine_test hybrid-eager 260 tests/gpu/test_ddtree_hybrid_gpu.py "greedy and True"
  engine_test hybrid-graphs 200 tests/gpu/test_ddtree_hybrid_gpu.py "greedy and False"
  engine_test hybrid-prefix-caching 120 tests/gpu/test_ddtree_hybrid_gpu.py \
    prefix_caching
  ;;
kernels)
  step tree-cores 90 python3 benchmarks/bench_tree_cores.py --out "$out/tree_cores.json"
  # Issue 3's grid (trees of 16 / 64 / 256 nodes); the engine's B = 64
  # shape (65 nodes) is the `shapes` mode's.
  step tree-attention 330 python3 benchmarks/bench_tree_attention.py \
    --trees 16,64,256 --out "$out/tree_attention.json"
  # The first GDN benchmark of a machine autotunes vLLM's FLA kernels (the
  # 2026-12-05 run timed out at 120 s; alone it took 220 s).
  step hybrid-verify 260 python3 benchmarks/bench_hybrid_verify.py \
    --out "$out/hybrid_verify.json"
  ;;
verify-costs)
  # (The build kernel's warp sweep, `bench_tree_cores.py --build-warps`, ran
  # here until its 2026-12-05 results chose 8 warps.)
  step gdn-kernels 150 python3 -m pytest -q -rf tests/gpu/test_tree_gdn_gpu.py
  step hybrid-verify 420 python3 benchmarks/bench_hybrid_verify.py \
    --out "$out/hybrid_verify.json"
  ;;
sweep)
  step tile-sweep 240 python3 benchmarks/bench_tree_attention.py --sweep --no-sdpa \
    --batches 1,4,16 --contexts 1024,4096 --trees 17,65 --out "$out/tile_sweep.json"
  ;;
cores)
  step cores-test 150 python3 -m pytest -q -rf tests/gpu/test_tree_cores_gpu.py
  step tree-cores 240 python3 benchmarks/bench_tree_cores.py --build-warps 2,4,8,16 \
    --out "$out/tree_cores.json"
  ;;
shapes)
  step engine-shapes 150 python3 benchmarks/bench_tree_attention.py --no-sdpa \
    --batches 1,4,16 --contexts 1024,4096 --trees 17,65 \
    --out "$out/tree_attention_engine_shapes.json"
  ;;
e2e-8b | e2e-8b-flash | e2e-8b-v1 | e2e-8b-async | e2e-8b-async-flash | e2e-8b-async-v2)
  # DDTree's first start on a fresh machine compiles its Triton variants
  # (about 90 s for the 8B geometry), hence the longer job timeout. The
  # async modes write a table of their own (ratios compare like with like;
  # E2E_BATCHES=1 for batch 1 only; E2E_LIMIT: seconds for the step, whose
  # finished engines are reported either way).
  e2e_8b=(python3 benchmarks/bench_e2e.py
    --target benchmarks/configs/qwen3-8b --drafter benchmarks/configs/qwen3-8b-dflash
    --load-format dummy --budgets 64 --fixed-budget
    --batch-sizes "${E2E_BATCHES:-1,16}"
    --temperatures 0 --prompt-len 768 --max-tokens 64
    --max-cudagraph-capture-size 1040 --job-timeout 280)
  table=e2e-8b
  case $mode in
  e2e-8b-async*)
    table=e2e-8b-async
    e2e_8b+=(--async-scheduling)
    ;;
  esac
  e2e_8b+=(--out "/tmp/$table")
  case $mode in
  e2e-8b | e2e-8b-async)
    step "$mode" "${E2E_LIMIT:-590}" "${e2e_8b[@]}" --methods nospec,dflash,ddtree ;;
  e2e-8b-flash | e2e-8b-async-flash)
    step "$mode" "${E2E_LIMIT:-300}" "${e2e_8b[@]}" --methods ddtree --flash-context ;;
  e2e-8b-v1)
    step e2e-8b-v1 "${E2E_LIMIT:-420}" "${e2e_8b[@]}" --methods nospec-v1,dflash-v1 ;;
  e2e-8b-async-v2)
    step "$mode" "${E2E_LIMIT:-590}" "${e2e_8b[@]}" --methods ${E2E_METHODS:-nospec,dflash,ddtree-v2} \
      ${E2E_SCHEDULE:+--schedule "$E2E_SCHEDULE"} ${E2E_CHAIN_FROM:+--chain-from "$E2E_CHAIN_FROM"} ;;
  esac
  e2e_report "$table"
  ;;
e2e-hybrid)
  # Qwen3.5-9B-like hybrid (Qwen3-Next layers: 24 GDN + 8 attention, dense
  # MLPs), dummy weights: a tree verify step vs a chain verify step. The
  # first engine of a fresh machine also autotunes the FLA kernels (~200 s).
  e2e_dummy e2e-hybrid qwen3next-9b
  ;;
e2e-qwen35)
  # The real Qwen3.5-9B architecture (Qwen3_5ForConditionalGeneration), now
  # that DDTree moves M-RoPE rows; token ids are placeholders in its vocab.
  e2e_dummy e2e-qwen35 qwen3.5-9b
  ;;
e2e-30b)
  # Qwen3-30B-A3B (MoE, 3B active), dummy weights: ~61 GB to initialise.
  e2e_dummy e2e-30b qwen3-30b-a3b --max-cudagraph-capture-size 1040
  ;;
profile)
  profile_8b
  ;;
profile-pair)
  profile_pair
  ;;
train)
  train_pair "${TRAIN_MINUTES:-8}" $((${TRAIN_MINUTES:-8} * 60 + 80))
  ;;
train-e2e)
  # The pair lives in /tmp: a machine lost between calls takes it along
  # (2026-12-03), so training shares its call with the first engines.
  # TRAIN_MINUTES (default 3) trades the pair's quality for the table's time;
  # on a fresh machine the first engine also compiles vLLM's kernels: the
  # pair's stock DFlash engine took 225 s to start on a fresh H200, 117 s of
  # them silent after its graph capture (2026-12-07), so a fresh machine's
  # e2e call wants ~350 s past training before its first row.
  # E2E_END: the call's end in seconds (default 585).
  train_pair "${TRAIN_MINUTES:-3}" $((${TRAIN_MINUTES:-3} * 60 + 60))
  e2e_pair $((${E2E_END:-585} - SECONDS)) e2e-h200 nospec,dflash 15
  ;;
e2e)
  e2e_pair 480 e2e-h200 ddtree 16,64
  ;;
e2e-more)
  e2e_pair 400 e2e-h200 ddtree,dflash-v1 256
  step parity 150 python3 benchmarks/reference_ddtree.py --pair /tmp/pair-h200 \
    --parity --budget 32 --num-prompts 16 --max-tokens 128 --out "$out/parity-h200.json"
  ;;
e2e-async)
  # The pair under vLLM's async scheduling (host work overlaps the GPU's),
  # every method: DDTree with fixed budgets; a table of its own.
  e2e_pair 560 e2e-h200-async nospec,dflash,ddtree 64 --async-scheduling --fixed-budget
  ;;
e2e-async-v2)
  # The same table, DDTree on the V2 runner (E2E_METHODS, default ddtree-v2);
  # E2E_SCHEDULE (e.g. 1-1:64,2-1024:15) sizes its trees by batch size;
  # E2E_CHAIN_FROM (e.g. 0,9): an engine per ddtree.chain_from_batch_size;
  # E2E_END: the table's end in seconds (default 560), when it shares a call.
  e2e_pair $((${E2E_END:-560} - SECONDS)) e2e-h200-async "${E2E_METHODS:-ddtree-v2}" "${E2E_BUDGETS:-64}" --async-scheduling \
    --fixed-budget ${E2E_SCHEDULE:+--schedule "$E2E_SCHEDULE"} \
    ${E2E_CHAIN_FROM:+--chain-from "$E2E_CHAIN_FROM"}
  ;;
train-e2e-async-v2)
  # A 3-minute pair, then no-spec, DFlash and DDTree on the V2 runner, all
  # async, in one call (E2E_BATCH_SIZES, e.g. 1,16, keeps it inside 600 s).
  train_pair "${TRAIN_MINUTES:-3}" $((${TRAIN_MINUTES:-3} * 60 + 60))
  # E2E_END: the call's end in seconds (default 585), e.g. the device time left.
  e2e_pair $((${E2E_END:-585} - SECONDS)) e2e-h200-async "${E2E_METHODS:-nospec,dflash,ddtree-v2}" \
    "${E2E_BUDGETS:-64}" \
    --async-scheduling --fixed-budget ${E2E_SCHEDULE:+--schedule "$E2E_SCHEDULE"} \
    ${E2E_CHAIN_FROM:+--chain-from "$E2E_CHAIN_FROM"}
  ;;
caches)
  # Triton loads a cached kernel from its metadata and binary; the
  # intermediate IRs stay behind (FlashInfer's build tree stays whole: its
  # JIT reruns ninja over it). Kernels (Triton, FlashInfer) and vLLM's
  # compile cache go in separate archives: the kernels are what every engine
  # reuses, vLLM's cache hits only for the same model and settings, so it is
  # left out when the parts would pass the 7 files a call can return here.
  tar czf /tmp/caches-kernels.tgz -C "$HOME" --exclude='*.ptx' --exclude='*.ttir' \
    --exclude='*.ttgir' --exclude='*.llir' --exclude='*.source' \
    .triton/cache .cache/flashinfer 2>/dev/null
  tar czf /tmp/caches-vllm.tgz -C "$HOME" .cache/vllm 2>/dev/null
  split -b 15M -d /tmp/caches-kernels.tgz "$out/caches-kernels.tgz.part-"
  parts=$(( $(stat -c %s /tmp/caches-vllm.tgz) / (15 << 20) + 1 ))
  if [ $(( $(ls "$out" | wc -l) + parts )) -le 7 ]; then
    split -b 15M -d /tmp/caches-vllm.tgz "$out/caches-vllm.tgz.part-"
  fi
  du -sh "$HOME/.triton/cache" "$HOME/.cache/flashinfer" "$HOME/.cache/vllm" \
    /tmp/caches-*.tgz 2>/dev/null
  ls -l "$out"
  ;;
*)
  echo "unknown mode $mode" >&2
  exit 2
  ;;
esac
tar czf "$pack" -C "$logs" .
