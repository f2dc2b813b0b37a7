source docs/bench/bench_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
python3 -c "import xgrammar, pydantic; print('xgrammar', xgrammar.__version__)"
git log --oneline | head -1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_structured_output.py tests/test_n_samples.py tests/test_logits.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_tests.txt | head -20
timeout 280 python3 docs/bench/request_features.py 2>&1 | grep -v Warning | tee $OUT/request_features.txt
