#!/usr/bin/env bash
# The next H200 lease's calls, as session 48 prepared them (no machine was lent in session 48). Run on the device as
#   source .carry/install.sh && bash docs/measurements/leases/s48-next-lease.sh A     (then B), carry [".carry"]
# Each call writes its logs and the tuned table under $OUT and prints a short table last.
#   A: the GPU tests of session 48's TMA-store epilogue (`TileConfig.tma_store`), then the DeepSeek config's expert classes (2,048 rows an expert: in no table, so every launch of session 47's
#      DeepSeek row ran the heuristic tile) tuned with the compile workers (their first GPU run: the tune's wall time is
#      the reading), then the DeepSeek row against transformers on that table (issue 20: 1.36x in session 47).
#   B: the Mixtral config's classes retuned (m2048, the H200 entries from session 42, before the Gluon kernels; the
#      `bench experts` mixtral-8x7b shape launches the same classes), then on that one table issue 20 item 3's row,
#      the Mixtral step against transformers, and the gate/up epilogue probe.
# Commit a retuned table only with its step measured in the same call (the rows against transformers are).
set -uo pipefail
mkdir -p "$OUT"
stamp() { echo "$1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"; }
common="routing=balanced hardware=h200-sxm"
case "${1:?A or B}" in
A)
  # session 48's TMA-store epilogue and compile workers first run here: the GPU tests of the stores, then the tune
  t0=$(date +%s); timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_moe_ffn.py -k "tma_stores or tma_row or reduce_added" \
    > "$OUT/gpu-tests-tma-store-h200.txt" 2>&1; stamp gpu-tests $?
  t0=$(date +%s); timeout 330 python3 -m disagmoe bench tune-experts -c configs/h200-deepseek-v3.yaml $common \
    > "$OUT/tune-deepseek-h200.txt" 2>&1; stamp tune $?
  cp disagmoe/kernels/tuned/nvidia-h200.json "$OUT/"
  t0=$(date +%s); timeout 240 python3 -m disagmoe bench train -c configs/h200-deepseek-v3.yaml --mode single \
    --baseline hf --steps 7 --warmup 4 $common --out "$OUT/deepseek-hf-retuned-h200.json" \
    > "$OUT/deepseek-hf-retuned-h200.log" 2>&1; stamp train $?
  tail -3 "$OUT/gpu-tests-tma-store-h200.txt"
  grep -E "compiling|ran [0-9]+ of|best by kernel| best " "$OUT/tune-deepseek-h200.txt" | cut -c1-150
  grep -E "^single|^hf-|expert tiles" "$OUT/deepseek-hf-retuned-h200.log" | cut -c1-160 ;;
B)
  t0=$(date +%s); timeout 300 python3 -m disagmoe bench tune-experts -c configs/h200-mixtral-8x7b.yaml $common \
    > "$OUT/tune-mixtral-h200.txt" 2>&1; stamp tune $?
  cp disagmoe/kernels/tuned/nvidia-h200.json "$OUT/"
  t0=$(date +%s); timeout 120 python3 -m disagmoe bench experts --main-grads --shape mixtral-8x7b \
    --backend grouped_mm --backend triton --markdown --out "$OUT/experts-mixtral-h200.json" \
    > "$OUT/experts-mixtral-h200.txt" 2>&1; stamp experts $?
  t0=$(date +%s); timeout 200 python3 -m disagmoe bench train -c configs/h200-mixtral-8x7b.yaml --mode single \
    --baseline hf --steps 7 --warmup 4 $common --out "$OUT/mixtral-hf-retuned-h200.json" \
    > "$OUT/mixtral-hf-retuned-h200.log" 2>&1; stamp train $?
  t0=$(date +%s); timeout 90 python3 docs/measurements/gate-up-epilogue-probe-s48.py \
    > "$OUT/gate-up-epilogue-h200.txt" 2>&1; stamp probe $?
  grep -E "compiling|ran [0-9]+ of|replaces|best by kernel| best " "$OUT/tune-mixtral-h200.txt" | cut -c1-150
  grep -E "^\| mixtral" "$OUT/experts-mixtral-h200.txt" | cut -c1-160
  grep -E "^single|^hf-" "$OUT/mixtral-hf-retuned-h200.log" | cut -c1-160
  cat "$OUT/gate-up-epilogue-h200.txt" ;;
esac
cat "$OUT/times.txt"
