#!/usr/bin/env bash
# The GPU check (issue 41): the GPU tier (tests/test_gpu.py, `pytest -m gpu`) on one CUDA device, about 10 minutes at
# most (compiling the Triton kernels takes most of it with a cold cache), then a short table of what ran.
# Usage: scripts/gpu-check.sh [extra pytest arguments]; run from the repository root with the project's .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi
out="${GPU_CHECK_OUT:-$(mktemp -d)}"
python - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY
timeout 600 python -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider --timeout 300 \
    --junitxml="$out/gpu.xml" "$@"
status=$?
python - "$out/gpu.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

rows = []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome = "passed"
    for kind in ("failure", "error", "skipped"):
        found = case.find(kind)
        if found is not None:
            outcome = f"{kind}: {(found.get('message') or '').splitlines()[0][:60]}" if found.get("message") else kind
    rows.append((case.get("name"), float(case.get("time", 0)), outcome))
width = max((len(name) for name, _, _ in rows), default=10)
print(f"\n{'check':<{width}}  {'s':>6}  outcome")
for name, seconds, outcome in rows:
    print(f"{name:<{width}}  {seconds:6.1f}  {outcome}")
PY
exit $status
