#!/usr/bin/env bash
# The main job: the three-arm study on the embedded SmolLM2-135M-Instruct (2 CPU ranks), then the
# commitment, scoring, validation, screens, report and plots, into runs/cpu-study/.
#   launch/study.sh [PLAN] [nshard.study args...]   (default launch/plans/cpu-study.toml)
set -euo pipefail
cd "$(dirname "$0")/.."
plan=${1:-launch/plans/cpu-study.toml}
[ $# -gt 0 ] && shift
exec .venv/bin/python -m nshard.study --plan "$plan" --out "runs/$(basename "$plan" .toml)" "$@"
