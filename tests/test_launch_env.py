"""The rank's process environment: threads sized from the cores the process may use, not the machine's."""

import json
import os
import subprocess
import sys

import pytest

CHILD = ("import json, torch; from nshard.seam.launch_env import prepare_process_env, usable_cores; "
         "prepare_process_env(); print(json.dumps([usable_cores(), torch.get_num_threads()]))")


def child_threads(cores: set[int]) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cores))
    return tuple(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_threads_follow_the_affinity_not_the_machine():
    """Inside a one-core cpuset (an emulated host) os.cpu_count() still counts every core; one thread per
    core the process may use is what avoids OpenMP spinning against the other rank."""
    everything = os.sched_getaffinity(0)
    assert child_threads({min(everything)}) == (1, 1)
    assert child_threads(everything) == (len(everything), len(everything))
