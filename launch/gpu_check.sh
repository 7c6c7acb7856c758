#!/usr/bin/env bash
# One GPU, at most 9 minutes, one JSON summary on stdout, each step's log in OUT/logs (docs/gpu.md):
#   launch/gpu_check.sh [--out DIR] [--dry-run] [--budget_s 540]
# --dry-run lists every step and checks its inputs and arguments on any machine, running nothing that needs a GPU.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
exec "${NSHARD_PYTHON:-$here/.venv/bin/python}" "$here/launch/gpu_check.py" "$@"
