#!/usr/bin/env bash
# One GPU session: stages given as arguments, in order (default: tests attention throughput).
#   tests       GPU tests (Triton kernels, the fused sampler, the whole model against transformers)
#   profile     bench/profile_decode.py: GPU busy and idle time, the kernels that take it
#   attention   bench/attention_bench.py
#   throughput  bench/throughput.py, in-process and through gRPC (random Qwen3-0.6B, bf16)
#   inprocess   bench/throughput.py, in-process only
#   fp8         bench/throughput.py in-process with --kv-cache-dtype fp8 (twice, one device call), then the
#               fp8 KV quality test on the tiny models (tests/worker_service/test_gpu_fp8_kv.py)
#   hf          bench/throughput.py, transformers' continuous batching vs ours on the first 32
# Logs go to $OUT (or ./out). Expects a CUDA machine with torch, triton, transformers; carried
# wheels in .whl (grpcio 1.85, health checking, reflection) are installed first if present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
for s in ${@:-tests attention throughput}; do
  echo "=== $s"
  case $s in
    tests) timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/worker_service/test_triton_attention.py \
             tests/worker_service/test_gpu_model.py tests/worker_service/test_sampler.py \
             tests/worker_service/test_fused_sampling.py tests/worker_service/test_triton_rope_store.py \
             tests/worker_service/test_triton_activation.py tests/worker_service/test_triton_fp8_kv.py \
             tests/worker_service/test_gpu_fp8_kv.py 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    profile) timeout 300 python3 bench/profile_decode.py 2>&1 | grep -v Warn | tee "$OUT/profile.log" | tail -40 ;;
    attention) timeout 240 python3 bench/attention_bench.py 2>&1 | tee "$OUT/attention.log" | tail -30 ;;
    throughput) timeout 540 python3 bench/throughput.py --modes inprocess,grpc --json-out "$OUT/throughput.json" \
             2>&1 | tee "$OUT/throughput.log" | tail -25 ;;
    inprocess) timeout 400 python3 bench/throughput.py --modes inprocess --json-out "$OUT/inprocess.json" \
             2>&1 | tee "$OUT/inprocess.log" | tail -25 ;;
    fp8) for run in 1 2; do
           timeout 300 python3 bench/throughput.py --modes inprocess --kv-cache-dtype fp8 \
             --json-out "$OUT/inprocess-fp8-$run.json" 2>&1 | tee "$OUT/inprocess-fp8-$run.log" | tail -8
         done
         timeout 300 python3 -m pytest -q -s -x -p no:cacheprovider tests/worker_service/test_gpu_fp8_kv.py \
           tests/worker_service/test_triton_fp8_kv.py 2>&1 | tee "$OUT/fp8-tests.log" | tail -15 ;;
    hf) timeout 540 python3 bench/throughput.py --modes inprocess,hf --json-out "$OUT/hf.json" \
             2>&1 | tee "$OUT/hf.log" | tail -25 ;;
    *) echo "unknown stage $s" ;;
  esac
done
