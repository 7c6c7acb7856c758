"""Warm ranks: a preloaded worker that forks the ranks of a launch, so a test that is not about the launcher skips
DeepSpeed's runner, its launch.py and each rank's imports (docs/testing.md#warm-ranks).

The worker (`python tests/warm.py`, one per pytest process, started on its first launch) imports torch, DeepSpeed,
transformers, the tiny model's and tokenizer's classes and nshard's trainer once. For each launch it forks one
process per rank, gives each the environment DeepSpeed's launch.py gives a rank (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, --local_rank) and the launch's own variables, and runs
nshard/train.py's main() there with the same arguments. Like launch.py it stops every rank when one exits non-zero
and exits with that rank's code. Each rank's stdout and stderr go to files that the test reads back in rank order.

A worker serves only launches whose variables read at import (HF_*, DS_*, TORCH_*, ...: READ_AT_IMPORT) have the
values it started with; the others (NSHARD_*, WANDB_*, ...) come with each launch. So each pytest process keeps a
few workers keyed by that signature (Pool): a launch with a signature not seen starts a worker of its own (a test
passed env=, or the session's environment changed: importing DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK,
transformers' modeling_utils TORCHINDUCTOR_CACHE_DIR), and the least recently used is closed past Pool.size.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "nshard" / "train.py"
READ_AT_IMPORT = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DS_", "DEEPSPEED", "TORCH", "PYTORCH", "OMP_", "MKL_", "CUDA",
                  "NCCL", "GLOO", "TOKENIZERS", "PYTHON", "LD_", "KMP_")
"""Prefixes of variables that torch, DeepSpeed, transformers or Python itself may read once, at import: a launch
must match the worker's on them to be run warm."""
POLL_S = 0.05
ANSWERS_FD = [-1]


# ---------------------------------------------------------------- the worker (its own process)

PRELOAD = ("torch", "torch.distributed", "deepspeed", "deepspeed.comm", "deepspeed.runtime.engine",
           "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.bf16_optimizer", "deepspeed.checkpoint",
           "deepspeed.ops.op_builder.all_ops", "transformers", "transformers.modeling_utils",
           "transformers.loss.loss_utils", "transformers.models.llama.modeling_llama",
           "transformers.models.mixtral.modeling_mixtral", "transformers.tokenization_utils_fast", "nshard.train",
           "nshard.run.training", "nshard.run.models", "nshard.run.replay", "nshard.run.elastic", "nshard.seam.engine",
           "nshard.seam.patches", "nshard.seam.ingest", "nshard.seam.reduction", "nshard.comm.overlap",
           "nshard.evidence.backend", "nshard.analysis.memory_model")
"""What a rank of nshard/train.py imports (a rank's `python -X importtime` against the worker's), not mpi4py.MPI:
importing it starts MPI, which a forked process must not inherit."""
LAZY_CLASSES = ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "LlamaConfig", "LlamaForCausalLM", "MixtralConfig",
                "MixtralForCausalLM", "PreTrainedTokenizerFast")


def preload() -> None:
    """Import PRELOAD and load DeepSpeed's CPU collective once; the forked ranks share these pages."""
    import importlib

    from nshard.seam.launch_env import prepare_process_env

    prepare_process_env()
    for name in PRELOAD:
        importlib.import_module(name)
    transformers = importlib.import_module("transformers")
    for name in LAZY_CLASSES:  # transformers imports a class's module when the class is first asked for
        getattr(transformers, name)
    from nshard.seam.engine import prebuild_cpu_collective

    prebuild_cpu_collective()  # loads it (DeepSpeed keeps the module: the ranks' init_distributed finds it loaded)


def run_rank(request: dict, rank: int, port: int, outputs: tuple[str, str]) -> None:
    """In the forked child: become rank `rank` of the launch and run the trainer; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: stopping the launch stops what the rank started
        os.close(ANSWERS_FD[0])  # the worker's answers are not the rank's to hold open
        for fd, path in zip((1, 2), outputs):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        world = request["world"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), LOCAL_SIZE=str(world), CROSS_RANK="0", CROSS_SIZE="1")
        sys.argv = [str(TRAIN), f"--local_rank={rank}", *request["args"]]
        import psutil

        from nshard import files
        from nshard.run import receipts
        from nshard.train import main

        receipts.PROCESS_START = psutil.Process().create_time()  # this rank's start, not the worker's
        receipts._MARKS.clear()
        files.ONE_TIME_WORK.clear()
        try:
            code = main(sys.argv[1:])
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except BaseException:  # noqa: BLE001 -- a forked rank must reach os._exit: its traceback goes to its stderr
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def stop(pids) -> None:
    """SIGKILL each rank's process group (the rank and whatever it started)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def exit_code(status: int) -> int:
    """A rank's wait status as launch.py's sys.exit(returncode) turns it into the launcher's exit code."""
    code = os.waitstatus_to_exitcode(status)
    return code & 0xFF


def serve_one(request: dict) -> dict:
    """Fork the ranks, wait like launch.py (the first non-zero exit stops the others), report."""
    from nshard.seam.launch_env import free_port

    port, logs = free_port(), Path(request["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    outputs = [(str(logs / f"rank-{r}.stdout"), str(logs / f"rank-{r}.stderr")) for r in range(request["world"])]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(request["world"]):
        pid = os.fork()
        if pid == 0:
            run_rank(request, rank, port, outputs[rank])
        with contextlib.suppress(OSError):  # as the rank does: a stop right after the fork reaches its group
            os.setpgid(pid, pid)
        pids.append(pid)
    running, code, timed_out = set(pids), 0, False
    deadline = time.monotonic() + request["timeout"]
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                timed_out = True
                stop(running)
            time.sleep(POLL_S)
            continue
        if pid not in running:
            continue
        running.discard(pid)
        if status != 0 and code == 0:
            code = exit_code(status) or 1
            stop(running)
    return {"returncode": code, "timed_out": timed_out, "outputs": outputs}


def serve() -> None:
    """Read one JSON request a line on stdin, answer one JSON line on the private descriptor; stop at end of input."""
    ANSWERS_FD[0] = os.dup(1)
    answers = os.fdopen(ANSWERS_FD[0], "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # a stray print must not break the answers
    os.close(null)
    preload()
    answers.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        answers.write(json.dumps(serve_one(json.loads(line))) + "\n")


# ---------------------------------------------------------------- the client (in the pytest process)

def signature(env: dict) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that something preloaded may read at import, with their values: two launches with the
    same signature may share a worker."""
    return tuple(sorted((k, v) for k, v in env.items() if k.upper().startswith(READ_AT_IMPORT)))


class Worker:
    """One preloaded worker, started with the environment of its first launch and stopped when closed (or when its
    stdin closes: the worker ends with the process that started it). A launch interrupted on this side (a test's
    timeout) stops the worker and its ranks: the next launch starts a new one, never reading a stale answer."""

    def __init__(self, env: dict):
        self.signature = signature(env)
        self.ready = False
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm worker exited ({self.proc.wait()})")
        return json.loads(line)

    def launch(self, args: list[str], world: int, env: dict, logs: Path, timeout: float) -> subprocess.CompletedProcess:
        if signature(env) != self.signature:  # its imports read other values: Pool.worker(env) has the right one
            raise ValueError(f"a launch whose variables read at import differ from the warm worker's: "
                             f"{sorted(set(signature(env)) ^ set(self.signature))}")
        request = {"args": [str(a) for a in args], "world": world, "env": env, "cwd": str(REPO), "logs": str(logs),
                   "timeout": timeout}
        try:
            if not self.ready:
                self.ready = self.answer()["ready"]  # the imports, once
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.answer()
        except BaseException:  # noqa: BLE001 -- re-raised: a half-read answer must never be read by the next launch
            self.kill()
            raise
        stdout = "".join(Path(o).read_text(errors="replace") for o, _ in answer["outputs"])
        stderr = "".join(Path(e).read_text(errors="replace") for _, e in answer["outputs"])
        cmd = ["warm", str(TRAIN), *request["args"]]
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, answer["returncode"], stdout, stderr)

    def kill(self) -> None:
        """Stop the worker and every rank it forked."""
        import psutil

        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        for p in [*family, self.proc]:
            try:
                p.kill()
            except (psutil.Error, ProcessLookupError):
                pass
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


class Pool:
    """This process's workers, one per signature, the most recently used last: at most `size` alive (each holds its
    own copy of the preloaded modules: 0.47 GiB resident on a 2-core Xeon with AMX)."""

    def __init__(self, size: int = 2):
        self.size = size
        self.workers: dict[tuple, Worker] = {}

    def worker(self, env: dict) -> Worker:
        """The worker for `env`'s signature: the live one, or a new one started with `env` (a worker that exited or
        was killed is never reused); the least recently used beyond `size` is closed."""
        key = signature(env)
        found = self.workers.pop(key, None)
        if found is None or not found.alive():
            found = Worker(env)
        self.workers[key] = found
        while len(self.workers) > self.size:
            self.workers.pop(next(iter(self.workers))).close()
        return found

    def close(self) -> None:
        while self.workers:
            self.workers.popitem()[1].close()


_POOL: list[Pool] = []


def worker(env: dict) -> Worker:
    """This process's worker for `env` (Pool.worker), the pool made on first use and closed at exit."""
    if not _POOL:
        import atexit

        _POOL.append(Pool())
        atexit.register(_POOL[0].close)
    return _POOL[0].worker(env)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    serve()
