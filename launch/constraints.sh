#!/usr/bin/env bash
# Rewrite constraints.txt (the exact version of every installed package, which launch/setup.sh installs with) from
# this checkout's .venv: nshard itself left out, torch without its local build tag (+cpu, +cu128), so one file
# serves the CPU wheel and a CUDA index's build. Run it after changing pyproject.toml's dependencies and
# `bash launch/setup.sh` (with the new pins allowed), then commit constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# Every package launch/setup.sh installs, at its exact version (written by launch/constraints.sh from a"
  echo "# set-up .venv on the CPU build machine; docs/testing.md#pinned-dependencies)."
  .venv/bin/python -m pip freeze --exclude-editable --exclude nshard 2>/dev/null | grep -v '^#' \
    | sed -E 's/^(torch==[^+]*)\+.*/\1/' | LC_ALL=C sort -f
} > constraints.txt.new
mv constraints.txt.new constraints.txt
