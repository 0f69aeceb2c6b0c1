#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment in .venv with lightning_dist and its test and docs extras (the
# tests lint with ruff and build the documentation site in strict mode).
# Without a GPU it installs torch's CPU wheel first (2.13.0 lies on this project's machines' disk), so the
# `torch` range in pyproject.toml is already met and pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".[test,docs]"
python -c "import lightning_dist, torch; print('lightning_dist', lightning_dist.__version__, 'torch', torch.__version__)"
