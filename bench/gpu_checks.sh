#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in one go, most wanted first: the embedded shards, the
# CUDA tests, the step throughput of VSRN at the paper's sizes (eager, compiled, compiled into CUDA
# graphs), a profile of that step, every recipe's eager step (MFU), VSRN's demo-size step compiled,
# the VSRN demo on CUDA (data wait per 20-step window, MFU), then the smaller benchmarks while time
# is left.
#   bash bench/gpu_checks.sh                  # GPU_CHECKS_BUDGET_S=580 by default
# Every step has its own time limit, cut to what is left of the budget, so one slow step leaves the
# others their time, and the whole script ends inside the budget. The logs and results come back as
# one archive, $OUT/gpu_checks.tgz (a lease returns at most 8 files); the steps' exits and tails
# are printed as they end. On 2026-12-04 (H200, 16 cores) the shards took 100 s with the CUDA tests
# beside them (so they now run alone), a compiled paper-size warm-up 111 s; the 570 s budget ended
# in the compiled runs. A second call to a machine still warm can take the steps left: `ONLY="demo
# gcn_kernel" bash bench/gpu_checks.sh` runs only the steps named (and the shards if missing).
# A GPU image without vldist's pure-Python needs (pydantic, webdataset, braceexpand, pycocoevalcap's
# Python files) takes them unpacked beside the tree: `unzip` their wheels into .whl/site here,
# carry .whl/site, and export PYTHONPATH=$PWD/.whl/site there. The captioning recipes (captioner,
# CL, L2C, LAViTeR) also need Java and METEOR's 62 MB paraphrase table, which do not fit a lease's
# 64 MiB: on an image without Java their rows fail at the start ("pycocoevalcap needs Java").
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
deadline=$(( $(date +%s) + ${GPU_CHECKS_BUDGET_S:-580} ))

step() {  # step LIMIT_S NAME COMMAND...: at most LIMIT_S seconds, and never past the deadline
  local limit=$1 name=$2; shift 2
  [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return
  local left=$(( deadline - $(date +%s) ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then echo "== $name: skipped, ${left} s left" | tee -a "$LOGS/steps.txt"; return; fi
  local start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$LOGS/steps.txt"
  tail -n "${TAIL:-12}" "$LOGS/$name.txt"
}

finish() { cp -r runs/gpu-demo/metrics.jsonl "$LOGS/demo_metrics.jsonl" 2>/dev/null
  tar czf "$OUT/gpu_checks.tgz" -C "$LOGS" . && cp "$LOGS/steps.txt" "$OUT/" 2>/dev/null; }
trap finish EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOGS/gpu.txt"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

[ -f shards/synth/manifest.json ] || ONLY= step 100 shards python3 -m vldist.shards synth --out shards/synth

# The CUDA tests, each test's outcome on its own line as it ends (a cut-short run still names them).
TESTS=(tests/unit/test_region_affinity_kernel.py tests/unit/test_cl_negatives.py tests/unit/test_generation.py
  tests/integration/test_two_branch_cuda.py tests/integration/test_laviter_cuda.py
  tests/integration/test_l2c_cuda.py tests/integration/test_captioning_cuda.py
  tests/integration/test_checkpoint_cuda.py tests/integration/test_profile_cuda.py
  tests/unit/test_rnn_flops.py tests/unit/test_optimizer_implementation.py tests/unit/test_channels_last.py
  tests/unit/test_decoder_loops.py tests/unit/test_device_prefetch.py tests/unit/test_compiling.py tests/unit/test_flops.py
  tests/unit/test_dropout.py
  "tests/integration/test_compile_equivalence.py::test_vsrn_compiled_into_cuda_graphs_takes_the_eager_step_on_cuda")
TAIL=40 step 240 cuda_tests python3 -m pytest -n 6 -p no:cacheprovider -v --tb=short --timeout 150 -o addopts="" -ra "${TESTS[@]}"

# Step throughput: VSRN at the paper's sizes, eager, compiled, compiled into CUDA graphs.
ST=(python3 bench/step_throughput.py --machine "$card" --window 20 --timeout 180 --json "$LOGS/step_throughput.json")
TAIL=8 step 260 throughput "${ST[@]}" --cases vsrn-paper --modes none step
TAIL=8 step 200 throughput_cuda_graphs "${ST[@]}" --append --cases vsrn-paper --modes step \
  --set train.compile_mode=reduce-overhead
# Where the paper-size step goes: two steps after warm-up, top operators by device time.
TAIL=16 step 60 profile python3 -m vldist.train vsrn model.embed_size=2048 data.max_regions=36 data.batch_size=128 \
  train.device=cuda engine.mixed_precision=bf16 output.dir=runs/gpu-profile train.max_steps=12 \
  train.profile_steps=10:11 train.validate_every=0 eval.baseline=false
TAIL=10 step 150 throughput_recipes "${ST[@]}" --append --modes none \
  --cases vsrn two_branch_embed two_branch_sim captioner laviter cl_caption l2c
TAIL=8 step 200 throughput_demo_compiled "${ST[@]}" --append --cases vsrn --modes step
TAIL=8 step 200 throughput_demo_cuda_graphs "${ST[@]}" --append --cases vsrn --modes step \
  --set train.compile_mode=reduce-overhead

# The demo as a user runs it on a GPU, with the MFU its metrics endpoint serves.
( while sleep 10; do curl -s 127.0.0.1:9400/metrics | grep -E "^vldist_(model_flops|samples_per_second|data_wait)"; done ) \
  > "$LOGS/demo_mfu.txt" 2>&1 &
poll=$!
TAIL=16 step 110 demo python3 -m vldist.train vsrn train.device=cuda engine.mixed_precision=bf16 output.dir=runs/gpu-demo
kill $poll
# The 20-step windows' throughput and data wait, as metrics.jsonl recorded them.
[ -f runs/gpu-demo/metrics.jsonl ] && python3 - <<'EOF' 2>&1 | tee -a "$LOGS/steps.txt"
import json
rows = [r for r in map(json.loads, open("runs/gpu-demo/metrics.jsonl")) if r.get("event") == "train"]
print("demo windows: samples/s", [round(r["samples_per_second"]) for r in rows])
print("demo windows: data wait %", [round(100 * r["data_wait_share"], 1) for r in rows])
EOF

TAIL=8 step 200 throughput_model "${ST[@]}" --append --cases vsrn-paper vsrn --modes model
step 60 decoder_launches python3 bench/decoder_launches.py --device cuda --json "$LOGS/decoder_launches_cuda.json"
step 120 cuda_switches python3 bench/cuda_switches.py --json "$LOGS"
step 60 gcn_kernel python3 bench/gcn_kernel.py --dtype bf16 --repeats 20
