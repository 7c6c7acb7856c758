#!/usr/bin/env bash
# The offline bundle for a lent GPU machine (docs/gpu.md#the-offline-bundle), built on a machine with the package index:
#   bash launch/gpu_bundle.sh [DIR]        (default .gpu-bundle, ignored by git)
# DIR gets the cp312 manylinux x86_64 wheels that the GPU image (Python 3.12, torch 2.11, transformers 5.17, numpy,
# mpi4py, ninja) lacks and the check imports -- DeepSpeed 0.19.8 built without ops, hjson, pydantic with its binary
# core and what pydantic needs, py-cpuinfo, tomli-w (nshard writes --set plans with it) -- plus nshard itself as a wheel, and requirements.txt, the list the device
# installs with no index (launch/gpu_device.sh). Downloaded wheels are cached in NSHARD_BUNDLE_CACHE (default
# ~/.cache/nshard-gpu-bundle), so a second build asks the index nothing. Prints DIR's size and the size of what a
# device call carries (the working tree that travels plus DIR), and fails past the device's 64 MiB.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
dir=${1:-.gpu-bundle}
cache=${NSHARD_BUNDLE_CACHE:-$HOME/.cache/nshard-gpu-bundle}
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
# Exact versions: what the rehearsal (launch/gpu_rehearse.sh) installed and ran. The device resolves DeepSpeed's and
# pydantic's needs against the image's packages and these wheels, with no index.
installs=(deepspeed==0.19.8 hjson==3.1.0 pydantic==2.14.4 py-cpuinfo==9.0.0 tomli-w==1.2.0)
needed=(pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
mkdir -p "$cache"
wheel_of() { find "$cache" -maxdepth 1 -iname "$(echo "${1%%==*}" | tr - _)-${1##*==}-*.whl" | head -1; }
cached() { [ -n "$(wheel_of "$1")" ]; }
binary=()
for pin in "${installs[@]:1}" "${needed[@]}"; do cached "$pin" || binary+=("$pin"); done
if [ ${#binary[@]} -gt 0 ]; then
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$cache" "${binary[@]}"
fi
# DeepSpeed ships an sdist: built here into a pure-Python wheel, no ops compiled (they JIT-build on first use).
cached "${installs[0]}" || DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps -w "$cache" "${installs[0]}"
rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
for pin in "${installs[@]}" "${needed[@]}"; do cp "$(wheel_of "$pin")" "$dir.tmp/"; done
# nshard from this checkout (its dependencies are the image's and the wheels above; installed with --no-deps).
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dir.tmp" . >/dev/null
rm -rf build nshard.egg-info
printf '%s\n' "${installs[@]}" > "$dir.tmp/requirements.txt"
rm -rf "$dir" && mv "$dir.tmp" "$dir"
bundle=$(du -sb "$dir" | cut -f1)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
echo "gpu_bundle: $dir: $(ls "$dir" | wc -l) files, $bundle bytes ($(( bundle / 1024 / 1024 )) MiB)"
echo "gpu_bundle: carried to the device: working tree $tree bytes + bundle $bundle bytes = $((tree + bundle)) of $limit"
if [ $((tree + bundle)) -gt $limit ]; then
  echo "gpu_bundle: over the device's 64 MiB: carry less (the working tree's untracked files count too)" >&2
  exit 1
fi
