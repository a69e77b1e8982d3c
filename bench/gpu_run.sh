#!/usr/bin/env bash
# One GPU session: stages given as arguments, in order (default: tests attention throughput).
#   tests       GPU tests (Triton kernels incl. the experts', the fused sampler, the whole model against transformers,
#               --deterministic)
#   profile     bench/profile_decode.py: GPU busy and idle time, the kernels that take it
#   attention   bench/attention_bench.py
#   throughput  bench/throughput.py, in-process and through gRPC (random Qwen3-0.6B, bf16)
#   inprocess   bench/throughput.py, in-process only
#   fp8         bench/throughput.py in-process and through gRPC with --kv-cache-dtype fp8 (twice, one device
#               call), then the fp8 KV quality test on the tiny models (tests/worker_service/test_gpu_fp8_kv.py)
#   fp8-kernel  bench/attention_bench.py at 256 random lengths 100-2047 (bf16 and fp8 caches, share of the copy
#               bandwidth), then, where Nsight Compute is installed, `ncu --set full` of one launch of the fp8
#               decode kernel in programs longest first (the NVTX range rand-fp8-lf) into $OUT/ncu-fp8-256.txt
#   fp8-quality bench/fp8_kv_quality.py on the GPU in bf16 against a float32 reference, 4 windows of 1,024 with
#               64 decode positions each, on the GGUF at $QUALITY_MODEL (the default model's, carried in parts
#               by ../shared/device/carry-big-file.sh); skipped with a line when it is unset
#               (issue 31: fp8 fp8-kernel fp8-quality throughput throughput latency, over calls of 600 s)
#   metrics     bench/throughput.py through gRPC with the scheduler's metrics recorded and served, and with
#               --metrics-port 0 (nothing recorded), twice each in alternating order (issue 11's 1 % bound)
#   hf          bench/throughput.py, transformers' continuous batching vs ours on the first 32
#   serving     bench/serving.py against `nanovllm worker` + `nanovllm scheduler` (random Qwen3-0.6B):
#               Poisson rates 4..32 and inf on the reference workload, single-stream 512/2048, then 256
#               concurrent streams of 1024+256 tokens; JSON and the scheduler's /metrics in $OUT
#               (plot afterwards where matplotlib is: python bench/serving.py --from-json F --plot F.png)
#   chain       bench/decode_chain.py: one decode layer's six kernels at one sequence in a CUDA graph, whole, each
#               left out, each alone (what each costs the chain under PDL), with and without PDL
#   latency     bench/single_stream.py (one stream in-process, profiled), then single-stream points through gRPC
#               (the default flags, then --decode-step-ms 0: a fixed 4 iterations a step; /metrics after each)
#   load        bench/serving.py at Poisson rates 8 and 16 (reference workload), the same two schedulers
#   moe         random Qwen3-30B-A3B (drawn in memory): the fused expert kernels against their floor
#               (bench/moe_bench.py --sweep), the reference workload in-process with one stream's ITL
#   moe-grpc    the same model behind `nanovllm worker` + `nanovllm scheduler`: one stream through gRPC
# Logs go to $OUT (or ./out). Expects a CUDA machine with torch, triton, transformers; carried
# wheels in .whl (grpcio 1.85, health checking, reflection; for the gRPC modes also smg-grpc-proto,
# prometheus-client and llguidance, which the scheduler imports) are installed first if present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
start_services() {  # a worker and a scheduler on $SERVICE_MODEL (random Qwen3-0.6B); extra scheduler flags as arguments
  name=${SERVICE_MODEL:-random-qwen3-0.6b} model=/tmp/nanovllm-bench/${SERVICE_MODEL:-random-qwen3-0.6b}
  wport=50161 port=50151 mport=50191
  NANOVLLM_WORKER_SECRET=$(python3 -c "import secrets; print(secrets.token_hex(16))"); export NANOVLLM_WORKER_SECRET
  python3 -c "from pathlib import Path; from bench.random_checkpoint import random_model_folder as m
m(Path('/tmp/nanovllm-bench'), '$name')"
  python3 -m launch.cli --log-level WARNING worker --model "$model" --port $wport >"$OUT/serving-worker.log" 2>&1 &
  worker=$!
  python3 -m launch.cli --log-level WARNING scheduler --worker 127.0.0.1:$wport --port $port --metrics-port $mport \
    "$@" >"$OUT/serving-scheduler.log" 2>&1 &
  scheduler=$!
}
serving_stage() {
  start_services
  timeout 420 python3 bench/serving.py --target 127.0.0.1:$port --request-rates 4,8,16,32,inf \
    --json-out "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log" | tail -12
  timeout 120 python3 bench/serving.py --target 127.0.0.1:$port --request-rates inf --max-concurrency 256 \
    --dataset fixed --input-len 1024 --output-len 256 --single-stream-prompt-lens "" \
    --json-out "$OUT/serving-c256.json" 2>&1 | tee "$OUT/serving-c256.log" | tail -4
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$mport/metrics').read().decode())" \
    >"$OUT/serving-metrics.txt"
  kill $scheduler $worker; wait $scheduler $worker
}
step_length_ab() {  # name, bench/serving.py flags: the default scheduler and one with --decode-step-ms 0 (fixed4),
  # in the order of $VARIANTS (default: "default fixed4"); after the first, a new scheduler takes the same worker over
  local name=$1 variant flags first=1; shift
  for variant in ${VARIANTS:-default fixed4}; do
    flags=""; [ $variant = fixed4 ] && flags="--decode-step-ms 0"
    if [ $first = 1 ]; then
      start_services $flags; first=0
    else
      kill $scheduler; wait $scheduler
      python3 -m launch.cli --log-level WARNING scheduler --worker 127.0.0.1:$wport --port $port \
        --metrics-port $mport --worker-takeover $flags >"$OUT/serving-scheduler-$variant.log" 2>&1 &
      scheduler=$!
    fi
    timeout 240 python3 bench/serving.py --target 127.0.0.1:$port "$@" \
      --json-out "$OUT/$name-grpc-$variant.json" 2>&1 | tee "$OUT/$name-grpc-$variant.log" | tail -6
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$mport/metrics').read().decode())" \
      >"$OUT/$name-metrics-$variant.txt"
  done
  kill $scheduler $worker; wait $scheduler $worker
}
latency_stage() {  # one stream in-process (with profiles), then through gRPC
  timeout 300 python3 bench/single_stream.py 2>&1 | grep -v Warn | tee "$OUT/single-stream.log" | tail -80
  step_length_ab latency --request-rates "" --num-warmup 4
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
declare -A runs  # how often each stage has run: a stage named twice (`throughput throughput`) keeps both logs
for s in ${@:-tests attention throughput}; do
  runs[$s]=$(( ${runs[$s]:-0} + 1 )); n=${runs[$s]}
  echo "=== $s ($n)"
  case $s in
    tests) timeout 540 python3 -m pytest -q -x -p no:cacheprovider tests/worker_service/test_triton_invariant.py \
             tests/worker_service/test_gpu_deterministic.py tests/worker_service/test_triton_attention.py \
             tests/worker_service/test_gpu_model.py tests/worker_service/test_sampler.py \
             tests/worker_service/test_fused_sampling.py tests/worker_service/test_triton_rope_store.py \
             tests/worker_service/test_triton_activation.py tests/worker_service/test_triton_fp8_kv.py \
             tests/worker_service/test_gpu_fp8_kv.py tests/worker_service/test_triton_norm.py \
             tests/worker_service/test_triton_skinny_matmul.py tests/worker_service/test_step_grammars.py \
             tests/worker_service/test_step_constraints.py tests/worker_service/test_logit_edits.py \
             tests/worker_service/test_fused_logit_edits.py tests/worker_service/test_prompt_logprobs.py \
             tests/worker_service/test_triton_moe.py \
             2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    profile) timeout 300 python3 bench/profile_decode.py 2>&1 | grep -v Warn | tee "$OUT/profile.log" | tail -40 ;;
    attention) timeout 240 python3 bench/attention_bench.py 2>&1 | tee "$OUT/attention.log" | tail -30 ;;
    throughput) timeout 540 python3 bench/throughput.py --modes inprocess,grpc --json-out "$OUT/throughput-$n.json" \
             2>&1 | tee "$OUT/throughput-$n.log" | tail -25 ;;
    inprocess) timeout 400 python3 bench/throughput.py --modes inprocess --json-out "$OUT/inprocess-$n.json" \
             2>&1 | tee "$OUT/inprocess-$n.log" | tail -25 ;;
    fp8) for run in 1 2; do
           timeout 400 python3 bench/throughput.py --modes inprocess,grpc --kv-cache-dtype fp8 \
             --json-out "$OUT/fp8-$run.json" 2>&1 | tee "$OUT/fp8-$run.log" | tail -8
         done
         timeout 300 python3 -m pytest -q -s -x -p no:cacheprovider tests/worker_service/test_gpu_fp8_kv.py \
           tests/worker_service/test_triton_fp8_kv.py 2>&1 | tee "$OUT/fp8-tests.log" | tail -15 ;;
    fp8-kernel) timeout 200 python3 bench/attention_bench.py --random-lengths 256 2>&1 \
           | tee "$OUT/attention-random-256.log" | tail -8
         if command -v ncu >/dev/null; then
           timeout 300 ncu --set full --clock-control none --nvtx --nvtx-include "rand-fp8-lf/" \
             -k regex:_decode_kernel --launch-skip 2 --launch-count 1 \
             python3 bench/attention_bench.py --random-lengths 256 >"$OUT/ncu-fp8-256.txt" 2>&1
           grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$OUT/ncu-fp8-256.txt"
         else echo "no ncu on this machine: the kernel's timing above is the evidence"; fi ;;
    fp8-quality) if [ -n "${QUALITY_MODEL:-}" ]; then
           timeout 500 python3 bench/fp8_kv_quality.py --device cuda --dtype bfloat16 --reference-dtype float32 \
             --model "$QUALITY_MODEL" --num-windows 4 --window-len 1024 --num-decode-positions 64 2>&1 \
             | tee "$OUT/fp8-quality.log" | tail -8
         else echo "fp8-quality: QUALITY_MODEL (the default model's GGUF) is not set; skipped"; fi ;;
    metrics) for order in grpc,grpc-no-metrics grpc-no-metrics,grpc; do
               timeout 280 python3 bench/throughput.py --modes $order --hf-num-seqs 0 \
                 --json-out "$OUT/metrics-${order%%,*}-first.json" 2>&1 | tee "$OUT/metrics-${order%%,*}-first.log" | tail -6
             done ;;
    hf) timeout 540 python3 bench/throughput.py --modes inprocess,hf --json-out "$OUT/hf.json" \
             2>&1 | tee "$OUT/hf.log" | tail -25 ;;
    serving) serving_stage ;;
    latency) latency_stage ;;
    chain) for flag in "" --without-pdl; do
             timeout 150 python3 bench/decode_chain.py $flag 2>&1 | tee -a "$OUT/decode-chain.log" | tail -14
           done ;;
    moe) timeout 200 python3 bench/moe_bench.py --sweep 2>&1 | tee "$OUT/moe-kernel.log" | tail -60
         timeout 420 python3 bench/throughput.py --model random-qwen3-30b-a3b --modes inprocess --hf-num-seqs 0 \
           --itl-tokens 256 --json-out "$OUT/moe-inprocess.json" 2>&1 | tee "$OUT/moe-inprocess.log" | tail -12 ;;
    moe-grpc) SERVICE_MODEL=random-qwen3-30b-a3b start_services
         timeout 500 python3 bench/serving.py --target 127.0.0.1:$port --request-rates "" --num-warmup 4 \
           --single-stream-prompt-lens 512 --json-out "$OUT/moe-single-stream.json" 2>&1 \
           | tee "$OUT/moe-single-stream.log" | tail -12
         kill $scheduler $worker; wait ;;
    load) step_length_ab load --request-rates 8,16 --single-stream-prompt-lens "" ;;
    *) echo "unknown stage $s" ;;
  esac
done
