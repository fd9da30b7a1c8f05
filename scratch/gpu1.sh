source .carry/install.sh
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > $OUT/gpu.txt
python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $OUT/gpu.txt
timeout 570 python3 -m pytest -q -p no:cacheprovider -m gpu -rA --junitxml=$OUT/junit.xml \
  tests/runtime/training/test_graphed_step.py tests/model/test_fp8_experts.py tests/kernels/test_fp8.py \
  tests/kernels/test_fp8_ffn.py "tests/kernels/test_permute.py" tests/runtime/state/test_flat_adamw.py \
  tests/runtime/training/test_micro_batches.py tests/runtime/stages/test_sparse_dispatch.py \
  "tests/runtime/cluster/test_driver.py" -k "not (transports_on_two_gpus or every_distributed_mode or resumes_in_another or killed_rank) and (not every_layout_on_one_shared_gpu or sparse or colocated-3) and (not no_host_waits_where or sparse)" > $OUT/tests.log 2>&1
echo rc=$?
grep -E "passed|failed|error" $OUT/tests.log | tail -3
grep -E "^(FAILED|ERROR)" $OUT/tests.log | cut -c1-300 | head -30
