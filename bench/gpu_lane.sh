#!/usr/bin/env bash
# The GPU lane: every test marked `gpu` (the kernels against float64 and the XLA path, the bf16
# tolerances, the lifecycle of tests/test_gpu_lane.py on 1 and 2 GPUs), run on a GPU host, and a
# dated record of the outcome appended to bench/GPU_LANE.md (or the file named by $1).
#
#   bash bench/gpu_lane.sh [RECORD.md [PYTEST ARGS...]]     (default: every gpu test under tests/)
#
# Run it whenever a change touches the step, the loop, checkpoints or the model. ISOJAX_COMMIT
# names the commit where the tree has no .git (a copy sent to a GPU machine). Wheels the host lacks
# may lie in .whl/ (installed into /tmp/site first).
set -uo pipefail
cd "$(dirname "$0")/.."
record=${1:-bench/GPU_LANE.md}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(tests)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:.${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
fi
export JAX_PLATFORMS=cuda,cpu PYTHONUNBUFFERED=1
commit=${ISOJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
log=$(mktemp)
start=$(date +%s)
python3 -m pytest -m gpu -p no:cacheprovider -rA -o addopts="" --durations=0 "${targets[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
summary=$(grep -E "^=+ .*(passed|failed|error|skipped).* =+$" "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
cards=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//' | paste -sd, -)
versions=$(python3 -c "
import importlib.metadata as m
print(', '.join(f'{p} {m.version(p)}' for p in ('jax', 'jaxlib', 'flax', 'orbax-checkpoint', 'tensorstore', 'transformers', 'torch')))")
{
    echo
    echo "## $(date -u +%Y-%m-%d\ %H:%M) UTC, commit $commit: ${summary:-no summary (exit $status)}"
    echo
    echo "- \`pytest -m gpu ${targets[*]}\`"
    echo
    echo "- cards: ${cards:-none found}; $(( $(date +%s) - start )) s; exit status $status"
    echo "- versions: $versions"
    echo
    echo '```'
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$log" | sed 's/ - .*//' | cut -c1-160
    echo '```'
} >> "$record"
exit "$status"
