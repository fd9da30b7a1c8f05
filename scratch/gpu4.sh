source .carry/install.sh >/dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/kernels/test_fp8.py tests/kernels/test_fp8_ffn.py tests/kernels/test_permute.py tests/model/test_fp8_experts.py tests/runtime/stages/test_sparse_dispatch.py > $OUT/tests.log 2>&1
echo tests rc=$?; grep -E "passed|failed" $OUT/tests.log | tail -1; grep -aE "^(FAILED|ERROR)" $OUT/tests.log | cut -c1-200
timeout 150 python3 -m disagmoe bench experts --precision fp8 --markdown > $OUT/experts_fp8.log 2>&1
echo experts rc=$?; grep -a "^|" $OUT/experts_fp8.log | cut -d'|' -f2,3,7,8,11,12,14,15
timeout 200 python3 -m disagmoe bench train -c configs/h200x2-qwen3-30b.yaml --mode single --steps 8 --warmup 3 --variant micro_batches=2 --variant 'micro_batches=2 precision=fp8' -o $OUT/train_fp8.json mode=single routing=balanced > $OUT/train_fp8.log 2>&1
echo train rc=$?; grep -a "│ single\|error" $OUT/train_fp8.log | cut -c1-200
