"""mpi4py and torch.distributed transports give the same reduction; this file is also the script mpirun runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from spawn import require

UPDATES = 4
CONFIG = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1, "min_compression_rate": 1, "seed": 3}
SHAPES = {"attn.weight": (12, 20), "mlp.weight": (20, 12), "norm.weight": (20,)}


def _grads(rank: int, update: int, dtype):
    import torch

    gen = torch.Generator().manual_seed(100 * update + rank)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in SHAPES.items()}


def _compare_transports(rank: int) -> None:
    """Same gradients through both transports, for the dense and PowerSGD reducers, fp32 and bf16."""
    import torch

    from nshard.comm import build_reducer

    for dtype in (torch.float32, torch.bfloat16):
        for reducer_name in ("dense", "powersgd"):
            config = {**CONFIG, "reducer": reducer_name}
            via_mpi, via_torch = build_reducer({**config, "transport": "mpi"}), build_reducer(config)
            for update in range(UPDATES):
                got, want = _grads(rank, update, dtype), _grads(rank, update, dtype)
                via_mpi.reduce(got)
                via_torch.reduce(want)
                for name in SHAPES:
                    # Two-rank sums are a single addition: fp32 must match bitwise; bf16 is summed in fp32 over MPI.
                    if dtype == torch.float32:
                        assert torch.equal(got[name], want[name]), (reducer_name, update, name)
                    else:
                        torch.testing.assert_close(got[name], want[name], rtol=1e-2, atol=1e-2)
            if dtype == torch.float32:
                assert via_mpi.ledger.records == via_torch.ledger.records


def main() -> None:
    """Entry point under mpirun: rank from Open MPI's environment, gloo beside MPI on loopback."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['NSHARD_TEST_PORT']}",
                            rank=rank, world_size=world)
    _compare_transports(rank)
    dist.barrier()
    dist.destroy_process_group()
    print(f"MPI-TRANSPORT-OK rank {rank}", flush=True)


def test_mpi_and_torch_transports_agree():
    require(shutil.which("mpirun") is not None, "mpirun not on PATH (apt-get install -y openmpi-bin libopenmpi-dev)")
    from spawn import free_port

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NSHARD_TEST_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
               "-x", "OMP_NUM_THREADS", "-x", "NSHARD_TEST_PORT", "-x", "PYTHONPATH",
               sys.executable, os.path.abspath(__file__)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in range(2):
        assert f"MPI-TRANSPORT-OK rank {rank}" in done.stdout


if __name__ == "__main__":
    main()
