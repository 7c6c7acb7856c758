#!/bin/sh
# Started by the deepspeed launcher (--no_python) in place of `python nshard/train.py`: join this
# rank's memory cgroup (v2 or v1), made by launch/memcap.py, then become the trainer with the same arguments.
# The group's limit then covers everything the rank allocates, imports included.
set -eu
group="${NSHARD_CGROUP_ROOT:?set by launch/memcap.py}/${NSHARD_CGROUP_PREFIX:?set by launch/memcap.py}-rank${LOCAL_RANK:?set by the deepspeed launcher}"
echo $$ > "$group/cgroup.procs"
exec "${NSHARD_PYTHON:?set by launch/memcap.py}" -u "${NSHARD_TRAIN:?set by launch/memcap.py}" "$@"
