# Sourced by a GPU lease script (docs/perf/*/lease.sh) run from the repository's root: the package installed over the
# machine's torch and Triton, the GPU and versions written to $OUT/gpu.txt, and `step LIMIT FILE CMD...`, which runs
# CMD for at most LIMIT seconds and appends the command, its output (less warnings) and its exit status to $OUT/FILE.
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
step() {
  local limit=$1 file=$2
  shift 2
  echo "\$ $*" >> "$OUT/$file"
  timeout "$limit" "$@" 2>&1 | grep -v -E "Warning|warnings.warn" >> "$OUT/$file"
  echo "exit $? after ${SECONDS}s" >> "$OUT/$file"
}
