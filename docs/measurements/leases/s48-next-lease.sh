#!/usr/bin/env bash
# The next H200 lease's calls, as session 48 prepared them (no machine was lent in session 48). On the device:
#   source .carry/install.sh && bash docs/measurements/leases/s48-next-lease.sh A     (then B, then C), carry [".carry"]
# Each call writes its logs and the tuned table under $OUT, prints a short table last, and stays under 600 s.
#   A: the GPU tests of session 48's TMA-store epilogues (`TileConfig.tma_store`), then the DeepSeek config's expert
#      classes (2,048 rows an expert: in no table, so every launch of session 47's DeepSeek row ran the heuristic
#      tile) tuned with the compile workers (their first GPU run: the tune's wall time and its "ran N of M" line are
#      the reading; session 47 compiled serially).
#   B: the DeepSeek row against transformers on call A's table (1.36x in session 47), then the Mixtral config's
#      classes retuned (m2048: the H200 entries date from session 42, before the Gluon kernels and the TMA stores;
#      `bench experts`' mixtral-8x7b shape launches the same classes).
#   C: on call B's table, issue 20 item 3's `bench experts` row (with `triton:tma-store` beside `triton`: every launch
#      writing by TMA, against the table's own choices, same run), the Mixtral step against transformers, and the
#      gate/up epilogue probe.
# The tables come back under $OUT: commit a retuned table only with its step measured on it (the rows against
# transformers are same-call ratios). Carry call A's table into B and B's into C (copy $OUT's nvidia-h200.json over
# disagmoe/kernels/tuned/ before the next call), since each call starts from the working tree.
set -uo pipefail
mkdir -p "$OUT"
stamp() { echo "$1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"; }
common="routing=balanced hardware=h200-sxm"
row() {  # $1: config, $2: record name
  t0=$(date +%s); timeout 230 python3 -m disagmoe bench train -c "configs/$1.yaml" --mode single --baseline hf \
    --steps 7 --warmup 4 $common --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1; stamp "$2" $?
}
case "${1:?A, B or C}" in
A)
  t0=$(date +%s); timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_moe_ffn.py tests/kernels/test_fp8.py \
    -k "tma_stores or tma_row or written_by_tma or quantising_swiglu_epilogue_writes" \
    > "$OUT/gpu-tests-tma-store-h200.txt" 2>&1; stamp gpu-tests $?
  t0=$(date +%s); timeout 420 python3 -m disagmoe bench tune-experts -c configs/h200-deepseek-v3.yaml $common \
    > "$OUT/tune-deepseek-h200.txt" 2>&1; stamp tune-deepseek $?
  cp disagmoe/kernels/tuned/nvidia-h200.json "$OUT/"
  tail -3 "$OUT/gpu-tests-tma-store-h200.txt"
  grep -E "compiling|ran [0-9]+ of|best by kernel| best " "$OUT/tune-deepseek-h200.txt" | cut -c1-150 ;;
B)
  row h200-deepseek-v3 deepseek-hf-retuned-h200
  t0=$(date +%s); timeout 330 python3 -m disagmoe bench tune-experts -c configs/h200-mixtral-8x7b.yaml $common \
    > "$OUT/tune-mixtral-h200.txt" 2>&1; stamp tune-mixtral $?
  cp disagmoe/kernels/tuned/nvidia-h200.json "$OUT/"
  grep -E "^single|^hf-|expert tiles" "$OUT/deepseek-hf-retuned-h200.log" | cut -c1-160
  grep -E "compiling|ran [0-9]+ of|replaces|best by kernel| best " "$OUT/tune-mixtral-h200.txt" | cut -c1-150 ;;
C)
  t0=$(date +%s); timeout 120 python3 -m disagmoe bench experts --main-grads --shape mixtral-8x7b \
    --backend grouped_mm --backend triton --backend triton:tma-store --markdown --out "$OUT/experts-mixtral-h200.json" \
    > "$OUT/experts-mixtral-h200.txt" 2>&1; stamp experts $?
  row h200-mixtral-8x7b mixtral-hf-retuned-h200
  t0=$(date +%s); timeout 90 python3 docs/measurements/gate-up-epilogue-probe-s48.py \
    > "$OUT/gate-up-epilogue-h200.txt" 2>&1; stamp probe $?
  grep -E "^\| mixtral" "$OUT/experts-mixtral-h200.txt" | cut -c1-160
  grep -E "^single|^hf-" "$OUT/mixtral-hf-retuned-h200.log" | cut -c1-160
  cat "$OUT/gate-up-epilogue-h200.txt" ;;
esac
cat "$OUT/times.txt"
