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


def test_a_compiled_cpu_collective_is_noted_as_one_time_work(tmp_path, monkeypatch):
    """The receipts' start-up names the one-time work a process did: DeepSpeed's CPU collective counts as compiled
    when its shared object under torch's extension directory is new or newer after the block, and not otherwise."""
    from nshard import files
    from nshard.seam.engine import _noting_a_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(files, "ONE_TIME_WORK", [])
    built = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    with _noting_a_build():
        pass  # nothing there before or after
    assert files.ONE_TIME_WORK == []
    with _noting_a_build():
        built.parent.mkdir(parents=True, exist_ok=True)
        built.write_bytes(b"compiled")
    with _noting_a_build():  # loaded as it was: not noted again
        pass
    assert files.ONE_TIME_WORK == [f"compiled DeepSpeed's CPU collective ({built})"]
    before = built.stat().st_mtime_ns
    with _noting_a_build():
        os.utime(built, ns=(before + 10**9, before + 10**9))  # rebuilt in place
    assert len(files.ONE_TIME_WORK) == 2


BUILD = ("import json; from nshard import files; from nshard.seam.engine import build_cpu_comm_extension; "
         "build_cpu_comm_extension(); print(json.dumps(files.ONE_TIME_WORK))")


def test_a_process_whose_path_finds_another_ninja_builds_nothing_again():
    """Two ninjas hash a build's command differently (PyPI's 1.13 in the venv, Debian's 1.11 in /usr/bin): each
    read the other's build as changed, so a process started without the venv's bin on PATH (an ssh launch, a
    script called by its path) compiled DeepSpeed's CPU collective again. Built once with the venv's bin first on
    PATH, a second process whose PATH has only the system's directories builds nothing and notes nothing."""
    from nshard.seam.launch_env import extensions_dir

    venv_bin = os.path.dirname(sys.executable)
    system = "/usr/local/bin:/usr/bin:/bin"

    def build(path: str) -> list:
        proc = subprocess.run([sys.executable, "-c", BUILD], env={**os.environ, "PATH": path},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    build(os.pathsep.join([venv_bin, system]))  # built now or earlier: either is fine
    built = os.path.join(extensions_dir(), "deepspeed_shm_comm", "deepspeed_shm_comm.so")
    before = os.stat(built).st_mtime_ns
    assert build(system) == []
    assert os.stat(built).st_mtime_ns == before


def test_a_cuda_arch_list_with_hopper_suffixes_reaches_deepspeeds_builder_plain(monkeypatch):
    """CUDA images for Hopper set TORCH_CUDA_ARCH_LIST entries such as "9.0a", which DeepSpeed 0.19.8's JIT builder
    cannot sort (int("0a")): FusedAdam failed so on an H200. A launched rank's environment takes the plain
    architectures, which the builder takes (no GPU is needed: in JIT mode it writes the list back for torch to emit
    its -gencode flags from)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from nshard.seam.launch_env import prepare_process_env

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a 10.0a+PTX")
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.compute_capability_args()
    prepare_process_env()
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0 10.0+PTX"
    assert builder.compute_capability_args() == []
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX"
