#!/usr/bin/env bash
# One GPU, at most 10 minutes, one JSON summary on stdout (docs/gpu.md):
#   launch/gpu_check.sh [--out DIR] [--dry-run] [--model tiny] [--budget_s 600]
# --dry-run lists every step and checks its inputs on any machine, running nothing that needs a GPU.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
exec "${NSHARD_PYTHON:-$here/.venv/bin/python}" "$here/launch/gpu_check.py" "$@"
