#!/usr/bin/env bash
# A/B of two isojax trees on one GPU, in one call (issue 37: the new measures' cost): the loop's
# rate at pythia-1.4b (bench_throughput, the peer in the same run, the baseline tree without it),
# then end to end with 8 sources, cached, this tree against the baseline (bench_end_to_end --baseline).
#
#   bash bench/ab_trees.sh BASELINE_TREE [CHARS]      (logs to $OUT, else /tmp/ab)
set -uo pipefail
cd "$(dirname "$0")/.."
base=$(cd "$1" && pwd); chars=${2:-17e6}
out=${OUT:-/tmp/ab}; mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
kernels=(--models pythia-1.4b --attention packed --mlp-kernel mosaic --norm-kernel pallas)
(cd "$base" && PYTHONPATH=$base:${PYTHONPATH:-} OUT= python3 -m bench.bench_throughput "${kernels[@]}" --no-peer) \
    2>&1 | grep -v "^{" | tee "$out/throughput_baseline.txt"
PYTHONPATH=.:${PYTHONPATH:-} OUT= python3 -m bench.bench_throughput "${kernels[@]}" 2>&1 | grep -v "^{" \
    | tee "$out/throughput.txt"
PYTHONPATH=.:${PYTHONPATH:-} OUT= python3 -m bench.bench_end_to_end --sources 8 --chars "$chars" --baseline "$base" \
    --no-peer --checkpoint-every 0 2>&1 | grep -v "^{" | tail -12 | tee "$out/end_to_end_8_sources.txt"
