source .carry/install.sh >/dev/null 2>&1
timeout 300 python3 -m disagmoe bench profile -c configs/h200x2-qwen3-30b.yaml mode=single routing=balanced micro_batches=2 precision=fp8 > $OUT/profile_fp8.log 2>&1
echo profile rc=$?
timeout 270 python3 -m disagmoe bench experts --precision fp8 --markdown > $OUT/experts_fp8.log 2>&1
echo experts rc=$?
tail -25 $OUT/experts_fp8.log | cut -c1-250
grep -a -E "busy|ms" $OUT/profile_fp8.log | head -30 | cut -c1-200
