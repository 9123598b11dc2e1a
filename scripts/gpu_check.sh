#!/usr/bin/env bash
# One-shot device check for a lent CUDA GPU, within 10 minutes: installs what CUDA needs (from a
# local wheel folder when the machine reaches no registry), runs the CUDA-marked tests (graph replay
# against eager passes among them) and the Triton kernel tests compiled for real, times 1- and
# 16-token passes eager and replayed from CUDA graphs (scripts/gpu_check.py), tries
# a short `localspec bench`, and writes one JSON report to ${OUT:-.}/gpu_check.json (steps'
# timeouts add up to 9.5 minutes).
#   usage: OUT=dir [WHEELS=dir] bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mkdir -p "$out"
log="$out/gpu_check.log"
: > "$log"
step() { echo "== $*" | tee -a "$log"; }

step install
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>>"$log"; then
  echo "torch cannot see a CUDA GPU" | tee -a "$log"
fi
pip_args=(-q)
if [ -n "${WHEELS:-}" ]; then pip_args+=(--no-index --find-links "$WHEELS"); fi
timeout 100 pip install "${pip_args[@]}" -e ".[test,cuda]" >>"$log" 2>&1; install_rc=$?

step "cuda-marked tests, Triton kernels compiled (TRITON_INTERPRET=0)"
TRITON_INTERPRET=0 OMP_NUM_THREADS=4 timeout 150 python -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  >"$out/pytest_cuda.txt" 2>&1; cuda_rc=$?
TRITON_INTERPRET=0 timeout 90 python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_bitsandbytes.py \
  >"$out/pytest_triton.txt" 2>&1; triton_rc=$?

step "pass timings"
timeout 170 python scripts/gpu_check.py >"$out/timings.json" 2>>"$log"; timings_rc=$?

step "short bench (needs the default pair in the local mirror)"
timeout 60 localspec bench --proposers none,ngram,draft --max-new-tokens 32 --no-hf --out "$out/bench.json" \
  >"$out/bench.txt" 2>&1; bench_rc=$?

python - "$out" "$install_rc" "$cuda_rc" "$triton_rc" "$timings_rc" "$bench_rc" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
names = ["install", "cuda_tests", "triton_and_bnb_tests", "timings", "bench"]
report = {"exit_codes": dict(zip(names, map(int, sys.argv[2:])))}
def tail(name, n=40):
    path = out / name
    return path.read_text(errors="replace").splitlines()[-n:] if path.exists() else None
report["cuda_tests"] = tail("pytest_cuda.txt")
report["triton_and_bnb_tests"] = tail("pytest_triton.txt")
try:
    report["timings"] = json.loads((out / "timings.json").read_text())
except (OSError, ValueError):
    report["timings"] = None
try:
    report["bench"] = json.loads((out / "bench.json").read_text())
except (OSError, ValueError):
    report["bench"] = tail("bench.txt", 10)
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(json.dumps(report["exit_codes"]))
PY
