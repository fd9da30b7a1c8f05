#!/usr/bin/env bash
# Session 50's lease calls (session 49's call N reordered: the item 3 row and the checked Zipf retune first, the block
# timer's GPU test after them). On the device: source .carry/install.sh && bash docs/measurements/leases/s50-lease.sh A
# (then B), carry [".carry"].
#   A: item 3's row on the committed table; the row's own shape retuned (block check on); the row again; the block
#      timer's GPU test; the block's launches profiled on the retuned, TMA-store and committed tiles.
#   C: item 3's row (its clocks beside the ceiling probe's), the clocks' GPU test, the DeepSeek tune, then on an
#      H200 the DeepSeek step (elsewhere the row again).
#   B: the DeepSeek config's expert classes tuned (never tuned on any card; block check on, its row GEMMs only since
#      its run pairs the weight gradients), then its step against transformers on that table.
set -uo pipefail
mkdir -p "$OUT"
card=$(python3 -c "import torch; print(torch.cuda.get_device_name())")
table=$(python3 -c "from disagmoe.kernels.tile_configs import gpu_slug; print(gpu_slug('$card') + '.json')")
case "$card" in *H200*) hw=h200-sxm ;; *H100*) hw=h100-sxm ;; *) echo "not a Hopper card: $card"; exit 2 ;; esac
echo "card: $card  hardware=$hw  table=$table  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader)" \
  | tee "$OUT/times.txt"
stamp() { echo "$1 rc=$2 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/times.txt"; }
row() {  # $1: config, $2: record name
  t0=$(date +%s); timeout 230 python3 -m disagmoe bench train -c "configs/$1.yaml" --mode single --baseline hf \
    --steps 7 --warmup 4 routing=balanced hardware=$hw --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1; stamp "$2" $?
}
experts() {  # $1: record name
  t0=$(date +%s); timeout 150 python3 -m disagmoe bench experts --main-grads --shape mixtral-8x7b \
    --backend grouped_mm --backend triton --backend triton:tma-store --markdown --out "$OUT/$1.json" \
    > "$OUT/$1.txt" 2>&1; stamp "$1" $?
}
case "${1:?A, B or C}" in
A)
  cp "disagmoe/kernels/tuned/$table" /tmp/committed-table.json
  experts experts-committed
  t0=$(date +%s); timeout 220 python3 -m disagmoe bench tune-experts --shape mixtral-8x7b > "$OUT/tune-zipf.txt" 2>&1
  stamp tune-zipf $?; cp "disagmoe/kernels/tuned/$table" "$OUT/"
  experts experts-retuned
  t0=$(date +%s); timeout 90 python3 -m pytest -q -m gpu tests/bench/test_tune_block.py > "$OUT/gpu-tests-block.txt" 2>&1
  stamp gpu-tests $?
  t0=$(date +%s); timeout 100 python3 docs/measurements/block-launches-probe-s49.py /tmp/committed-table.json \
    > "$OUT/block-launches.txt" 2>&1; stamp probe $?
  tail -2 "$OUT/gpu-tests-block.txt"
  grep -E "ran [0-9]+ of|block check| best " "$OUT/tune-zipf.txt" | cut -c1-200
  grep -hE "^\| mixtral" "$OUT/experts-committed.txt" "$OUT/experts-retuned.txt" | cut -c1-170
  tail -30 "$OUT/block-launches.txt" | cut -c1-200 ;;
B)
  t0=$(date +%s); timeout 270 python3 -m disagmoe bench tune-experts -c configs/h200-deepseek-v3.yaml \
    routing=balanced hardware=$hw > "$OUT/tune-deepseek.txt" 2>&1; stamp tune-deepseek $?
  cp "disagmoe/kernels/tuned/$table" "$OUT/"
  row h200-deepseek-v3 deepseek-hf
  grep -E "ran [0-9]+ of|block check| best " "$OUT/tune-deepseek.txt" | cut -c1-200
  grep -E "^single|^hf-|expert tiles" "$OUT/deepseek-hf.log" | cut -c1-180 ;;
C)
  experts experts-clocks-1  # first: the row on a cold GPU, with its clocks
  t0=$(date +%s); timeout 60 python3 -m pytest -q -m gpu tests/bench/test_experts.py -k clocks \
    > "$OUT/gpu-tests-clocks.txt" 2>&1; stamp gpu-tests $?
  t0=$(date +%s); timeout 200 python3 -m disagmoe bench tune-experts -c configs/h200-deepseek-v3.yaml \
    routing=balanced hardware=$hw > "$OUT/tune-deepseek.txt" 2>&1; stamp tune-deepseek $?
  cp "disagmoe/kernels/tuned/$table" "$OUT/"
  case "$card${SKIP_STEP:-}" in  # SKIP_STEP=1: the row again instead of the step (a short budget)
    *H200) row h200-deepseek-v3 deepseek-hf ;;  # 3.9B parameters' state: an H200 only
    *) experts experts-clocks-2 ;;  # the row again on the GPU the tune warmed
  esac
  tail -2 "$OUT/gpu-tests-clocks.txt"
  grep -hE "^\| mixtral|SM clock|  mixtral" "$OUT"/experts-clocks-*.txt | cut -c1-200
  grep -E "ran [0-9]+ of|block check| best " "$OUT/tune-deepseek.txt" | cut -c1-200
  [ -f "$OUT/deepseek-hf.log" ] && grep -E "^single|^hf-|expert tiles" "$OUT/deepseek-hf.log" | cut -c1-180 ;;
esac
cat "$OUT/times.txt"
