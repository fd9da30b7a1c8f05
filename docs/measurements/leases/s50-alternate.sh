set -u; mkdir -p $OUT; t=disagmoe/kernels/tuned/nvidia-h100-80gb-hbm3.json; cp $t /tmp/committed.json
for i in 1 2 3; do for v in committed retuned; do
  [ $v = committed ] && cp /tmp/committed.json $t || cp docs/measurements/tuned-h100-zipf-retuned-s50.json $t
  python3 -m disagmoe bench experts --main-grads --shape mixtral-8x7b --backend grouped_mm --backend triton --markdown > $OUT/alt-$i-$v.txt 2>&1
  echo "$i $v $(grep -E 'triton fwd|matmul 8192' $OUT/alt-$i-$v.txt | tr '\n' ' ')"
done; done
