#!/usr/bin/env bash
# The main job on the embedded default: SmolLM2-135M-Instruct, 2 CPU ranks, DeepSpeed, into runs/demo.
#   launch/demo.sh [ds_config]   (default ds_configs/powersgd.json; ds_configs/dense.json for the dense arm)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-ds_configs/powersgd.json}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash launch/run.sh --master_port "${MASTER_PORT:-29511}" -- --ds_config "$config" \
  --plan launch/plans/demo.toml --out "runs/demo-$(basename "$config" .json)" --overwrite
