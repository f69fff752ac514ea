#!/usr/bin/env bash
# The live harness on GPT-2 small (random weights), in one go, in under 5 minutes:
#   1. calibrate the engine (its own server, policy none),
#   2. replay a Poisson trace at nominal load 1.0 and a burst of 30 under all four policies
#      (four resident servers, order rotated, speed probes; `qlab live`),
#   3. compare every run with the simulator (`qlab compare`),
#   4. measure the batched GPT-2 engine's tokens/s at batch 1..32 against batch 1 (benchmarks/bench_gpt2_batch.py),
#   5. leave a summary and everything else in $OUT (default ./gpu_check_out):
#        summary.txt, bench_gpt2_batch.txt, summary.parquet, calibration.json, compare.parquet (all runs, per request),
#        gpu_check.tar.gz (run files, compare figures, server logs, the experiment file).
# On CUDA: a 40 s trace. Without a GPU (detected) the same steps run on the CPU with a
# shorter trace and fewer calibration requests, so the script is checked anywhere.
# Usage: bash benchmarks/gpu_check.sh        (PYTHON=... to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
OUT="${OUT:-./gpu_check_out}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
qlab() { "$PYTHON" -m experiments "$@"; }

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    DEVICE=cuda SECONDS_=40 LOAD=1.0 BURST=30 ROUNDS=2 PER_SIZE=6
    BATCH_BENCH=(--batches 1,2,4,8,16,32)
else
    DEVICE=cpu SECONDS_=10 LOAD=0.6 BURST=12 ROUNDS=1 PER_SIZE=2
    BATCH_BENCH=(--prompt-tokens 32 --new-tokens 16 --repeat 1)
fi
echo "gpu_check: device $DEVICE, Poisson ${SECONDS_} s at nominal load $LOAD, burst of $BURST, calibration $ROUNDS x $PER_SIZE per size"

cat > "$WORK/gpu_check.toml" <<EOF
# Written by benchmarks/gpu_check.sh
[server]
engine = "gpt2"
model = "random"
device = "$DEVICE"
policies = ["none", "bounded", "bounded-deadline", "predictive"]
startup_timeout_s = 240

[calibrate]
rounds = $ROUNDS
per_size = $PER_SIZE

[probe]
requests = 3
max_new_tokens = 16

[[trace]]
name = "poisson"
arrivals = "poisson"
nominal_load = $LOAD
seconds = $SECONDS_
seed = 1

[[trace]]
name = "burst"
arrivals = "burst:$BURST"
seed = 1
EOF

start=$(date +%s)
status=0
qlab live "$WORK/gpu_check.toml" --out "$WORK/live" | tee "$WORK/live.log" || status=$?
for run in "$WORK"/live/runs/*.parquet; do
    name="$(basename "$run" .parquet)"
    qlab compare "$run" --out "$WORK/compare/$name" > "$WORK/compare-$name.txt" || status=$?
done

"$PYTHON" - "$WORK" "$DEVICE" "$(( $(date +%s) - start ))" > "$WORK/summary.txt" <<'EOF' || status=$?
import json, sys
from pathlib import Path
import pandas as pd

work, device, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cal = json.loads((work / "live" / "calibration.json").read_text())
m = cal["model"]
print(f"gpu_check on {device}, {seconds} s in all")
print(f"calibration: intercept {m['intercept_s'] * 1e3:.2f} ms, {m['per_token_s'] * 1e3:.3f} ms/token; error of the "
      f"line on one request: median {cal['median_rel_error']:.1%}, worst {cal['worst_rel_error']:.1%}")
for r in cal["rounds"]:
    print(f"  round {r['round']}: {r['model']['per_token_s'] * 1e3:.3f} ms/token, median {r['median_rel_error']:.1%}, "
          f"worst {r['worst_rel_error']:.1%}")
s = pd.read_parquet(work / "live" / "summary.parquet")
cols = ["trace", "policy", "position", "nominal_load", "effective_load", "speed_before", "speed_after", "requests",
        "good", "late", "rejected", "expired", "error", "goodput_rps", "good_tokens_per_s", "latency_p50_s",
        "latency_p99_s", "refusal_p50_s", "send_lateness_p99_s", "sim_disagreements", "sim_disagreement_rate",
        "sim_latency_abs_error_p50_s", "sim_latency_abs_error_p99_s"]
with pd.option_context("display.width", 250, "display.max_columns", 40):
    print(s[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
joined = pd.concat([pd.read_parquet(p).assign(run=p.parent.name) for p in sorted((work / "compare").glob("*/compare.parquet"))])
joined.to_parquet(work / "compare.parquet", index=False)
total = joined["live_outcome"].ne("error").sum()
wrong = (~joined["agree"] & joined["live_outcome"].ne("error")).sum()
print(f"simulator vs service over all runs: {wrong} of {total} requests disagree ({wrong / max(total, 1):.1%})")
EOF
cat "$WORK/summary.txt"

"$PYTHON" benchmarks/bench_gpt2_batch.py --model random --device "$DEVICE" "${BATCH_BENCH[@]}" \
    | tee "$WORK/bench_gpt2_batch.txt" || status=$?

for f in summary.txt bench_gpt2_batch.txt live/summary.parquet live/calibration.json compare.parquet; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" .
echo "gpu_check: wrote $OUT (exit status $status)"
exit "$status"
