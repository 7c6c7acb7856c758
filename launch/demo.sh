#!/usr/bin/env bash
# One training run on the embedded default: SmolLM2-135M-Instruct, 2 CPU ranks, DeepSpeed, into
# runs/demo-<ds_config name> (runs/demo-powersgd, runs/demo-dense), replacing an earlier one there.
#   launch/demo.sh [ds_config] [--resume]   (default ds_configs/powersgd.json; ds_configs/dense.json for dense)
# --resume continues that directory from its newest complete state instead of replacing it.
set -euo pipefail
cd "$(dirname "$0")/.."
config=ds_configs/powersgd.json
mode=--overwrite
for arg in "$@"; do
  case "$arg" in
    --resume) mode=--resume ;;
    -*) echo "launch/demo.sh: unknown option $arg (it takes a ds_config and --resume)" >&2; exit 2 ;;
    *) config=$arg ;;
  esac
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
bash launch/run.sh --master_port "${MASTER_PORT:-29511}" -- --ds_config "$config" \
  --plan launch/plans/demo.toml --out "runs/demo-$(basename "$config" .json)" "$mode"
