#!/usr/bin/env bash
# Tensor and data parallelism on the two-GPU machine (nvidia-h200-x2). Stages, in order:
#   check  bench/tp_check.py: float32 greedy TP=2 vs TP=1 (graphs, eager); bf16 teacher-forced
#          top-1 at TP=2 vs transformers (random Qwen3-0.6B shapes)
#   tp8b   reference workload on random Qwen3-8B shapes (bf16), in-process, TP=1 then TP=2, each
#          followed by single-stream ITL; the TP=2 run ends with a torch.profiler summary; then TP=2
#          again with every sum on NCCL (NANOVLLM_TP_SYMMETRIC_SUMS=0)
#   dp     reference workload on random Qwen3-0.6B through gRPC: one worker, then two (one per GPU)
#   bash bench/tp_gpu.sh check dp    # about 6 minutes
#   bash bench/tp_gpu.sh tp8b        # about 3 minutes
# Logs and JSON go to $OUT (or ./out); the last lines are a table (bench/tp_summary.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # KINDS.md: NVLink multicast stays off
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(date -u +%FT%TZ)" | tee -a "$OUT/gpu.txt"
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" python3 bench/throughput.py --hf-num-seqs 0 --json-out "$OUT/$name.json" "$@" \
    2>&1 | grep --line-buffered -v Warn | tee "$OUT/$name.log" | tail -8
}
for s in ${@:-check tp8b dp}; do
  case $s in
    check) echo "=== check"; timeout 480 python3 bench/tp_check.py --json-out "$OUT/tp_check.json" 2>&1 \
             | grep --line-buffered -v Warn | tee "$OUT/tp_check.log" | tail -6 ;;
    tp8b) bench tp1-8b 220 --model random-qwen3-8b --modes inprocess --tensor-parallel-size 1 --itl-tokens 256
          bench tp2-8b 200 --model random-qwen3-8b --modes inprocess --tensor-parallel-size 2 --itl-tokens 256 \
            --torch-profile "$OUT/profile-tp2-8b.txt"
          NANOVLLM_TP_SYMMETRIC_SUMS=0 bench tp2-8b-nccl 200 --model random-qwen3-8b --modes inprocess \
            --tensor-parallel-size 2 --itl-tokens 256 ;;
    dp) bench dp1-0.6b 120 --modes grpc --num-workers 1
        bench dp2-0.6b 120 --modes grpc --num-workers 2 ;;
    *) echo "unknown stage $s" ;;
  esac
done
python3 bench/tp_summary.py "$OUT"
