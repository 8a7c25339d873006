#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in one go: the step throughput of VSRN (paper sizes and
# the demo) eager and compiled, the CUDA tests, the region-affinity kernel
# against eager and torch.compile, and the VSRN demo on CUDA (with its MFU read from the metrics
# endpoint). Logs go to $OUT (or ./gpu-out). Each step has its own time limit so one slow step
# leaves the others their time.
#   bash bench/gpu_checks.sh
# A GPU image without vldist's pure-Python needs (pydantic, webdataset, pycocoevalcap's Python
# files) takes them as wheels carried beside the tree, installed with
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` and PYTHONPATH=/tmp/site.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

start=$(date +%s)
timeout 90 python3 -m vldist.shards synth --out shards/synth > "$OUT/demo.txt" 2>&1
echo "shards built in $(( $(date +%s) - start )) s" | tee -a "$OUT/demo.txt"

# First, so that even a short session fills the CUDA rows of docs/benchmarks.md ("Step throughput").
timeout 330 python3 bench/step_throughput.py --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
  --cases vsrn-paper vsrn --modes none model step --window 10 --timeout 100 --json "$OUT/step_throughput.json" \
  > "$OUT/step_throughput.txt" 2>&1; tail -12 "$OUT/step_throughput.txt"

timeout 180 python3 -m pytest -n 0 -p no:cacheprovider -q -o addopts="" -ra \
  tests/unit/test_region_affinity_kernel.py tests/unit/test_cl_negatives.py tests/unit/test_generation.py \
  tests/integration/test_two_branch_cuda.py tests/integration/test_laviter_cuda.py \
  tests/integration/test_l2c_cuda.py tests/integration/test_captioning_cuda.py \
  tests/integration/test_checkpoint_cuda.py tests/integration/test_profile_cuda.py \
  tests/unit/test_rnn_flops.py tests/unit/test_optimizer_implementation.py tests/unit/test_channels_last.py tests/unit/test_decoder_loops.py tests/unit/test_device_prefetch.py 2>&1 | tee "$OUT/cuda_tests.txt" | tail -25

# Kernel launches per training step of each decoder, per-token reference against the loops as built.
timeout 150 python3 bench/decoder_launches.py --device cuda --json "$OUT/decoder_launches_cuda.json" \
  > "$OUT/decoder_launches.txt" 2>&1; tail -20 "$OUT/decoder_launches.txt"

# Fused Adam, TF32 and channels-last, each off and on (docs/results/cuda_switches_<card>.json).
timeout 240 python3 bench/cuda_switches.py --json "$OUT" > "$OUT/cuda_switches.txt" 2>&1; tail -14 "$OUT/cuda_switches.txt"

(timeout 80 python3 bench/gcn_kernel.py --repeats 20 && timeout 60 python3 bench/gcn_kernel.py --dtype bf16 --repeats 20) \
  > "$OUT/gcn_kernel.txt" 2>&1; tail -5 "$OUT/gcn_kernel.txt"

( while sleep 15; do curl -s 127.0.0.1:9400/metrics | grep -E "^vldist_(model_flops|samples_per_second|cuda_memory)" ; done ) >> "$OUT/mfu.txt" 2>&1 &
poll=$!
start=$(date +%s)
timeout 150 python3 -m vldist.train vsrn train.device=cuda engine.mixed_precision=bf16 output.dir=runs/gpu-demo >> "$OUT/demo.txt" 2>&1; rc=$?
echo "trained in $(( $(date +%s) - start )) s, exit $rc" | tee -a "$OUT/demo.txt"
kill $poll
tail -15 "$OUT/demo.txt"; sort -u "$OUT/mfu.txt" | tail -8

# What checkpoints cost the steps on one GPU: synchronous vs asynchronous, plain vs sharded.
timeout 300 python3 bench/checkpoint_overhead.py --ranks 1 --steps 120 --every 40 --repeats 2 \
  --json "$OUT/checkpoint_overhead.json" > "$OUT/checkpoint_overhead.txt" 2>&1; tail -8 "$OUT/checkpoint_overhead.txt"
