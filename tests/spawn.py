"""Run a function in N real gloo processes and hand back each rank's result (or the child's traceback)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback

from nshard.seam.launch_env import free_port  # tests import it from here


PRELOAD = ["torch", "torch.distributed"]
"""Imported once by the fork server the gloo ranks are forked from (not the CUDA ones: spawned, as CUDA needs)."""


def _child(fn, rank, world_size, port, args, results, backend="gloo", env=None):
    if env is not None:  # a forked rank has the fork server's environment: take the test's, as a spawned one would
        os.environ.clear()
        os.environ.update(env)
    # Two ranks on two cores: OpenMP spin-waiting otherwise makes collectives 50-200x slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        # Pickled to bytes here so tensors travel by value, not through shared-memory handles.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- handed to the parent, which names the rank
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size: int = 2, args: tuple = (), timeout_s: float = 120.0, backend: str = "gloo") -> list:
    """fn(rank, world_size, *args) in `world_size` processes; returns results by rank. gloo ranks are forked from a
    fork server that imported torch once (multiprocessing's forkserver, one per test process), with the test's
    environment; backend "nccl" spawns them and puts rank r on GPU r (the CUDA tests)."""
    import launches

    described = {"command": f"{fn.__module__}.{fn.__qualname__} on {world_size} {backend} rank(s)"}
    with launches.launching("spawn", described):
        return _run_ranks(fn, world_size, args, timeout_s, backend)


def _run_ranks(fn, world_size, args, timeout_s, backend) -> list:
    if backend == "gloo":
        ctx, env = mp.get_context("forkserver"), dict(os.environ)
        ctx.set_forkserver_preload(PRELOAD)
    else:
        ctx, env = mp.get_context("spawn"), None
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, backend, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    by_rank, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(by_rank) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in by_rank and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead or 'all'} died or timed out without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            by_rank[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:  # a failed rank leaves its peers blocked in a collective
            if p.is_alive():
                p.kill()
    return [by_rank[r] for r in range(world_size)]


def require(present: bool, what: str) -> None:
    """Skip a test whose machine lacks `what` (a tool, cores); in CI (CI set), where launch/setup.sh installs
    everything the suite uses, fail instead: a skip there would hide a missing part."""
    import pytest

    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{what}: CI must provide it (launch/setup.sh installs the tools the suite uses)")
    pytest.skip(what)
