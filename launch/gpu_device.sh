#!/usr/bin/env bash
# What a lent GPU machine runs (docs/gpu.md#the-device-command), in the repository root, with the bundle carried:
#   bash launch/gpu_device.sh [gpu_check.py's options: --steps A,B  --budget_s 420  --dry-run ...]
# No package index is reached. A venv that sees the image's packages (its Python: NSHARD_BASE_PYTHON, default python3)
# gets the bundle (NSHARD_BUNDLE, default .gpu-bundle: launch/gpu_bundle.sh) installed with --no-index; a second call on
# the same warm machine finds it installed. Then launch/gpu_check.py runs with the hub offline, its runs in
# NSHARD_CHECK_OUT (default /tmp/nshard-gpu-check, kept between calls so --steps can finish what the first left), and its
# summary (gpu-check.json) and logs (gpu-check-logs.tar.gz) written to $OUT, which the device tool returns.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
base=${NSHARD_BASE_PYTHON:-python3}
bundle=$(cd "${NSHARD_BUNDLE:-.gpu-bundle}" && pwd)
venv=${NSHARD_DEVICE_VENV:-/tmp/nshard-venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
stamp="$venv/.nshard-bundle"
want=$(cat "$bundle"/*.whl "$bundle/requirements.txt" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  t0=$(date +%s)
  # The image's Python is itself a venv (its torch lives there): a venv made from it sees only the base interpreter's
  # packages, so a .pth line adds the image's site-packages (its own .pth files processed too), after the venv's own.
  "$base" -m venv --clear --without-pip "$venv"
  image_sites=$("$base" -c 'import site, sys; print(" ".join(p for p in site.getsitepackages() if p.startswith(sys.prefix)))')
  own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for site in $image_sites; do echo "import site; site.addsitedir('$site')"; done > "$own/nshard_image_site.pth"
  # The image's pip, run by the venv's Python, installs into the venv; DeepSpeed's and pydantic's needs are resolved
  # against the image's packages and the bundle, nothing else.
  "$venv/bin/python" -m pip install -q --no-index --find-links "$bundle" -r "$bundle/requirements.txt"
  "$venv/bin/python" -m pip install -q --no-index --no-deps --find-links "$bundle" nshard
  echo "$want" > "$stamp"
  echo "gpu_device: bundle installed into $venv in $(( $(date +%s) - t0 )) s ($("$venv/bin/python" -V))" >&2
fi
results=${OUT:-$here/runs/gpu-check-results}
exec "$venv/bin/python" launch/gpu_check.py --out "${NSHARD_CHECK_OUT:-/tmp/nshard-gpu-check}" --results "$results" "$@"
