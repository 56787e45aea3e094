#!/usr/bin/env bash
# s25 call05: the new exit-steps counter test and the rider_gemm_bench helper tests on the H200 (CUDA graphs),
# with two run-ahead tests beside them. Repo root.
python3 -m pip install -q --no-build-isolation --no-deps . || { echo "project build failed"; exit 3; }
python3 -P -m pytest -q -p no:cacheprovider tests/test_rider_gemm_bench.py tests/test_runahead.py \
  -k "exit_steps or same_tokens or riders_join or rider_gemm or split_views or variants" 2>&1 | tail -n 30 | tee "$OUT/pytest.log"
