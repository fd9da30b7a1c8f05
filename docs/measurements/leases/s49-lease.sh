#!/usr/bin/env bash
# Session 49's lease calls: session 48's plan (s48-next-lease.sh) reordered so that issue 20 item 3's reading comes
# first, and made to work on whichever Hopper card comes (an H100 is now lent first; the hardware preset and the
# tuned table follow the card). On the device:
#   source .carry/install.sh && bash docs/measurements/leases/s49-lease.sh X   (then Y, then Z), carry [".carry"]
#   X: the GPU tests of session 48's TMA-store epilogues, item 3's `bench experts` row with `triton:tma-store` beside
#      `triton` (same run), and the gate/up epilogue probe.
#   Y: the Mixtral config's expert classes retuned (the tuner now offers the TMA-store tiles; the compile workers'
#      first GPU run), then the Mixtral step against transformers on that table.
#   Z: the DeepSeek config's classes tuned, then its step against transformers on that table.
#   R: item 3's row on the table as committed; the row's own shape (`--shape mixtral-8x7b`, Zipf-routed) retuned with
#      the tuner's new candidates (Gluon, TMA stores) and the row again; the balanced Mixtral config tuned (its /even
#      classes since 778cd5f) and the row again (unchanged where the loads keep their classes apart); then, where the
#      card holds it (an H200), the Mixtral step against transformers. Session 49 saw on an H100 that the Mixtral
#      classes tuned on balanced loads cost the Zipf row 5-7 points (84%/77% -> 79%/70%) when they shared its keys.
#   N: the next lease's first call (session 49 built the block check after its last machine): the block check's GPU
#      test, then call R's first half (the row, the Zipf retune now checked as a block, the row again): the reading is
#      the "block check" lines and whether the retuned row is no slower than the committed one; then the block's
#      launches profiled on the retuned table, every launch by TMA, and the committed table
#      (docs/measurements/block-launches-probe-s49.py): which launch loses time in the block.
# Copy the card's table from $OUT over disagmoe/kernels/tuned/ before the next call; commit a table only with its step.
set -uo pipefail
mkdir -p "$OUT"
card=$(python3 -c "import torch; print(torch.cuda.get_device_name())")
table=$(python3 -c "from disagmoe.kernels.tile_configs import gpu_slug; print(gpu_slug('$card') + '.json')")
case "$card" in *H200*) hw=h200-sxm ;; *H100*) hw=h100-sxm ;; *) echo "not a Hopper card: $card"; exit 2 ;; esac
echo "card: $card  hardware=$hw  table=$table" | tee "$OUT/times.txt"
common="routing=balanced hardware=$hw"
stamp() { echo "$1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"; }
row() {  # $1: config, $2: record name
  t0=$(date +%s); timeout 230 python3 -m disagmoe bench train -c "configs/$1.yaml" --mode single --baseline hf \
    --steps 7 --warmup 4 $common --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1; stamp "$2" $?
}
tune() {  # $1: config, $2: log name, $3: limit
  t0=$(date +%s); timeout "$3" python3 -m disagmoe bench tune-experts -c "configs/$1.yaml" $common \
    > "$OUT/$2.txt" 2>&1; stamp "$2" $?
  cp "disagmoe/kernels/tuned/$table" "$OUT/"
}
experts() {  # $1: record name
  t0=$(date +%s); timeout 150 python3 -m disagmoe bench experts --main-grads --shape mixtral-8x7b \
    --backend grouped_mm --backend triton --backend triton:tma-store --markdown --out "$OUT/$1.json" \
    > "$OUT/$1.txt" 2>&1; stamp "$1" $?
}
case "${1:?X, Y, Z, R or N}" in
X)
  t0=$(date +%s); timeout 100 python3 -m pytest -q -m gpu tests/kernels/test_moe_ffn.py tests/kernels/test_fp8.py \
    -k "tma_stores or tma_row or written_by_tma or quantising_swiglu_epilogue_writes" \
    > "$OUT/gpu-tests-tma-store.txt" 2>&1; stamp gpu-tests $?
  t0=$(date +%s); timeout 150 python3 -m disagmoe bench experts --main-grads --shape mixtral-8x7b \
    --backend grouped_mm --backend triton --backend triton:tma-store --markdown --out "$OUT/experts-mixtral.json" \
    > "$OUT/experts-mixtral.txt" 2>&1; stamp experts $?
  t0=$(date +%s); timeout 120 python3 docs/measurements/gate-up-epilogue-probe-s48.py \
    > "$OUT/gate-up-epilogue.txt" 2>&1; stamp probe $?
  tail -3 "$OUT/gpu-tests-tma-store.txt"
  grep -E "^\| " "$OUT/experts-mixtral.txt" | cut -c1-170
  cat "$OUT/gate-up-epilogue.txt" ;;
Y)
  tune h200-mixtral-8x7b tune-mixtral 330
  row h200-mixtral-8x7b mixtral-hf-retuned
  grep -E "compiling|ran [0-9]+ of|replaces|best by kernel| best " "$OUT/tune-mixtral.txt" | cut -c1-150
  grep -E "^single|^hf-|expert tiles" "$OUT/mixtral-hf-retuned.log" | cut -c1-160 ;;
Z)
  tune h200-deepseek-v3 tune-deepseek 330
  row h200-deepseek-v3 deepseek-hf-retuned
  grep -E "compiling|ran [0-9]+ of|replaces|best by kernel| best " "$OUT/tune-deepseek.txt" | cut -c1-150
  grep -E "^single|^hf-|expert tiles" "$OUT/deepseek-hf-retuned.log" | cut -c1-160 ;;
R)
  experts experts-committed
  t0=$(date +%s); timeout 200 python3 -m disagmoe bench tune-experts --shape mixtral-8x7b > "$OUT/tune-zipf.txt" 2>&1
  stamp tune-zipf $?; cp "disagmoe/kernels/tuned/$table" "$OUT/"
  experts experts-retuned
  tune h200-mixtral-8x7b tune-balanced 150  # the /even classes since 778cd5f: the Zipf row's stay
  experts experts-after-balanced
  case "$card${SKIP_STEP:-}" in *H200) row h200-mixtral-8x7b mixtral-hf-loads-tiles ;; esac  # SKIP_STEP=1: not
  grep -E "compiling|ran [0-9]+ of|replaces| best " "$OUT/tune-zipf.txt" "$OUT/tune-balanced.txt" | cut -c1-200
  grep -hE "^\| mixtral" "$OUT/experts-committed.txt" "$OUT/experts-retuned.txt" "$OUT/experts-after-balanced.txt" \
    | cut -c1-170
  [ -f "$OUT/mixtral-hf-loads-tiles.log" ] && grep -E "^single|^hf-" "$OUT/mixtral-hf-loads-tiles.log" | cut -c1-160 ;;
N)
  cp "disagmoe/kernels/tuned/$table" /tmp/committed-table.json
  t0=$(date +%s); timeout 120 python3 -m pytest -q -m gpu tests/bench/test_tune_block.py > "$OUT/gpu-tests-block.txt" 2>&1
  stamp gpu-tests $?
  experts experts-committed
  t0=$(date +%s); timeout 200 python3 -m disagmoe bench tune-experts --shape mixtral-8x7b > "$OUT/tune-zipf.txt" 2>&1
  stamp tune-zipf $?; cp "disagmoe/kernels/tuned/$table" "$OUT/"
  experts experts-retuned
  t0=$(date +%s); timeout 120 python3 docs/measurements/block-launches-probe-s49.py /tmp/committed-table.json \
    > "$OUT/block-launches.txt" 2>&1; stamp probe $?  # table (retuned), tma-store, and the committed one
  tail -2 "$OUT/gpu-tests-block.txt"
  grep -E "ran [0-9]+ of|block check| best " "$OUT/tune-zipf.txt" | cut -c1-200
  grep -hE "^\| mixtral" "$OUT/experts-committed.txt" "$OUT/experts-retuned.txt" | cut -c1-170
  tail -40 "$OUT/block-launches.txt" | cut -c1-200 ;;
esac
cat "$OUT/times.txt"
