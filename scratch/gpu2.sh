source .carry/install.sh
timeout 580 python3 -m disagmoe bench train -c configs/h200x2-qwen3-30b.yaml --mode single --steps 10 --warmup 4 \
  --variant micro_batches=2 --variant 'micro_batches=auto' --variant 'micro_batches=2 cuda_graphs=on' \
  --variant 'micro_batches=2 precision=fp8' -o $OUT/train.json routing=balanced > $OUT/train.log 2>&1
echo rc=$?
tail -40 $OUT/train.log | cut -c1-250
