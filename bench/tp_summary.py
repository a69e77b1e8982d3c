"""The table at the end of bench/tp_gpu.sh, from the JSON files of its stages in one folder.

    python bench/tp_summary.py out
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _throughput(run: dict | None, mode: str) -> tuple[float, dict] | None:
    entry = (run or {}).get("results", {}).get(mode)
    if not entry:
        return None
    return entry["all"]["output_tokens"] / entry["all"]["seconds"], entry


def main(folder: Path) -> None:
    print(f"{'measure':44} {'value':>30}")
    check = _load(folder, "tp_check")
    if check:
        for name in ("greedy_graphs", "greedy_eager", "temperature_graphs"):
            run = check.get(f"float32_{name}")
            if run is None:
                continue
            value = f"{run['sequences_exact']}/{run['sequences']} seqs, {run['tokens_equal']}/{run['tokens']} tok"
            label = f"fp32 {name.replace('_', ' ')} TP=2 vs TP=1 ({run.get('sums', '?')})"
            print(f"{label:52} {value:>30}")
        teacher = check["bfloat16_teacher_forced"]
        value = f"top-1 {teacher['top1_agreement']:.4f}, rel err {teacher['relative_error']:.2e}"
        print(f"{'bf16 teacher-forced TP=2 vs transformers':44} {value:>30}")
        for key, label in (("tp1_top1_agreement", "TP=1"), ("transformers_bf16_top1_agreement", "transformers bf16"),
                           ("tp2_vs_transformers_bf16_top1", "TP=2 vs transformers bf16")):
            if key in teacher:
                print(f"{'bf16 teacher-forced top-1, ' + label:44} {teacher[key]:>30.4f}")
    rates = {}
    for tp, name in ((1, "tp1-8b"), (2, "tp2-8b"), ("2, sums on NCCL", "tp2-8b-nccl")):
        found = _throughput(_load(folder, name), "inprocess")
        if found is None:
            continue
        rates[tp], entry = found
        print(f"{f'8B reference workload TP={tp} (tok/s)':44} {rates[tp]:>30.0f}")
        if entry.get("single_stream"):
            single = entry["single_stream"]
            value = f"{single['itl_ms']:.2f} / {single['ttft_s'] * 1e3:.1f}"
            print(f"{f'8B single stream TP={tp} ITL / TTFT (ms)':44} {value:>30}")
        if entry.get("profile"):
            prof = entry["profile"]
            value = f"{prof['collectives_ms']:.1f} of {prof['device_total_ms']:.1f} ms kernels"
            print(f"{f'8B TP={tp} decode profile, collectives':44} {value:>30}")
    for tp in (2, "2, sums on NCCL"):
        if 1 in rates and tp in rates:
            print(f"{f'8B TP={tp} / TP=1 throughput':44} {rates[tp] / rates[1]:>30.2f}")
    dp = {}
    for workers in (1, 2):
        found = _throughput(_load(folder, f"dp{workers}-0.6b"), "grpc")
        if found is not None:
            dp[workers] = found[0]
            print(f"{f'0.6B via gRPC, {workers} worker(s) (tok/s)':44} {dp[workers]:>30.0f}")
    if len(dp) == 2:
        print(f"{'0.6B data parallel 2 / 1 workers':44} {dp[2] / dp[1]:>30.2f}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "out"))
