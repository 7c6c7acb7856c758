#!/usr/bin/env bash
# The lent GPU machine's procedure, rehearsed on this CPU machine without the package index (docs/gpu.md#the-rehearsal):
#   bash launch/gpu_rehearse.sh [WORK]      (WORK: a scratch folder, default a new one under /tmp, removed unless given)
# 1. An environment holding only what the GPU image holds, made once in NSHARD_REHEARSAL_CACHE (default
#    ~/.cache/nshard-gpu-rehearsal) from Python 3.12 (NSHARD_PYTHON312) and the index: torch 2.11.0 and transformers
#    5.17.0 as the image has them (PyPI's torch for Linux is its CUDA build, which runs on a CPU: ~2.6 GB of wheels,
#    ~6 GB installed), numpy, mpi4py, ninja and the image's other packages the check imports; pydantic, which the
#    index's typer pulls in and the image lacks, removed. Later runs ask the index nothing.
# 2. The bundle (launch/gpu_bundle.sh, its wheels cached too).
# 3. launch/gpu_device.sh exactly as the device runs it, pip without any index or config, the hub offline: the
#    check's dry run, then its steps that run on a CPU (--cpu). Exit 0 only if both pass.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
cache=${NSHARD_REHEARSAL_CACHE:-$HOME/.cache/nshard-gpu-rehearsal}
py312=${NSHARD_PYTHON312:-}
if [ -z "$py312" ]; then  # a pyenv shim answers `command -v` without a working interpreter: ask each for its version
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    if "$candidate" -V >/dev/null 2>&1; then py312=$candidate; break; fi
  done
fi
if [ -n "${1:-}" ]; then work=$1; mkdir -p "$work"; else work=$(mktemp -d /tmp/nshard-rehearsal.XXXXXX); trap 'rm -rf "$work"' EXIT; fi
# What the image holds that the check touches (KINDS.md's package list; versions as the image reports where known).
image=(torch==2.11.0 transformers==5.17.0 numpy mpi4py ninja psutil einops msgpack nvidia-ml-py packaging
       safetensors tokenizers tqdm accelerate scipy pytest pytest-xdist pytest-timeout typing-extensions)
absent=(pydantic pydantic-core annotated-types typing-inspection deepspeed hjson py-cpuinfo)
stamp="$cache/image/.nshard-image"
if [ "$(cat "$stamp" 2>/dev/null)" != "${image[*]}" ]; then
  [ -n "$py312" ] || { echo "gpu_rehearse: no Python 3.12 found: set NSHARD_PYTHON312" >&2; exit 2; }
  t0=$(date +%s)
  mkdir -p "$cache/wheels"
  "$py312" -m pip download -q -d "$cache/wheels" "${image[@]}"
  "$py312" -m venv --clear "$cache/image"
  "$cache/image/bin/python" -m pip install -q --no-index --find-links "$cache/wheels" "${image[@]}"
  "$cache/image/bin/python" -m pip uninstall -q -y "${absent[@]}" 2>/dev/null || true
  echo "${image[*]}" > "$stamp"
  echo "gpu_rehearse: image environment built in $(( $(date +%s) - t0 )) s: $(du -sh "$cache/image" | cut -f1)," \
       "wheels $(du -sh "$cache/wheels" | cut -f1)" >&2
fi
"$cache/image/bin/python" - "${absent[@]}" <<'EOF'
import importlib.util, sys
present = [name for name in sys.argv[1:] if importlib.util.find_spec(name.replace("-", "_").replace("py_cpuinfo", "cpuinfo"))]
sys.exit(f"gpu_rehearse: the image stand-in holds {present}, which the GPU image lacks" if present else 0)
EOF
bash launch/gpu_bundle.sh "$work/bundle"
run() {  # launch/gpu_device.sh as the device runs it, with no index and no pip config (DeepSpeed's CPU collective,
         # which the device never builds, compiled once into the cache)
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u VIRTUAL_ENV NSHARD_BASE_PYTHON="$cache/image/bin/python" \
    NSHARD_BUNDLE="$work/bundle" NSHARD_DEVICE_VENV="$work/venv" NSHARD_CHECK_OUT="$work/check" \
    TORCH_EXTENSIONS_DIR="$cache/torch_extensions" \
    OUT="$work/out-$1" bash launch/gpu_device.sh "${@:2}"
}
status=0
run dry --dry-run > "$work/dry.out" || status=$?
tail -1 "$work/dry.out"
[ $status -eq 0 ] || { echo "gpu_rehearse: the dry run failed (exit $status): $work/out-dry/gpu-check.json" >&2; exit 1; }
run cpu --cpu --budget_s 7200 > "$work/cpu.out" || status=$?
tail -1 "$work/cpu.out"
[ $status -eq 0 ] || { echo "gpu_rehearse: the CPU steps failed (exit $status): $work/out-cpu/gpu-check.json" >&2; exit 1; }
echo "gpu_rehearse: ok: $("$work/venv/bin/python" -c 'from importlib.metadata import version as v; print(*(f"{n} {v(n)}" for n in ("torch", "transformers", "deepspeed")))')"
