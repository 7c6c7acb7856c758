#!/usr/bin/env bash
# Launch nshard/train.py with DeepSpeed's launcher after checking the hostfile.
#   launch/run.sh [--hostfile FILE] [deepspeed launcher args...] -- --ds_config ds_configs/dense.json [train args...]
# A hostfile that names only localhost runs every slot here, on loopback, without ssh
# (DeepSpeed's plain form insists on passwordless ssh to localhost); other hostfiles use the plain form.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=${NSHARD_PYTHON:-$here/.venv/bin/python}
hostfile=$here/hostfile
launcher_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  if [ "$1" = "--hostfile" ]; then hostfile=$2; shift 2; else launcher_args+=("$1"); shift; fi
done
[ "${1:-}" = "--" ] && shift
hosts=$("$py" -m nshard.run.hostfile "$hostfile")
if [ "${hosts%%:*}" = "localhost" ] && [ "$(echo "$hosts" | wc -w)" = 1 ]; then
  launcher_args+=(--no_ssh_check --master_addr 127.0.0.1)
fi
exec "$(dirname "$py")/deepspeed" --hostfile "$hostfile" "${launcher_args[@]}" "$here/nshard/train.py" "$@"
