"""Entry point started by the deepspeed launcher (or torchrun, or mpirun): parse, build, run, close.

    deepspeed --hostfile hostfile nshard/train.py --ds_config ds_configs/dense.json [--plan P] [--out DIR]
        [--set SECTION.KEY=VALUE ...] [--overwrite | --resume [--elastic]]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # launched as a script path: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nshard.cli import (SPELLING_NOTE, ArgumentParser, add_ds_config_arguments, add_plan_overrides,
                        ds_config_path, plan_with_overrides)
from nshard.seam.launch_env import prepare_process_env

IMPORT_FIX = ("install nshard with its dependencies (bash launch/setup.sh, or pip install -e .; on a lent GPU machine "
              "the bundle: docs/gpu.md#the-offline-bundle)")


EPILOG = """\
Writes the run directory (--out, default runs/<plan name>): plan.toml and ds_config.json (copies of the plan and
ds_config it ran; with --set, the plan with its overrides), run.json (status and identity), metrics.jsonl (one line
per update), prepared/ (the tokenized inputs and their identity), receipts/rank-<r>.json, state/ (complete states
for --resume) and model/ (the export, a transformers directory). docs/evidence.md#the-run-directory lists them.
--resolved_ds_config FILE writes only FILE and trains nothing.
""" + SPELLING_NOTE


def build_parser() -> argparse.ArgumentParser:
    from nshard.run.plan import DEFAULT_PLAN

    parser = ArgumentParser(description=__doc__, epilog=EPILOG)
    add_ds_config_arguments(parser)
    parser.add_argument("--plan", default=str(DEFAULT_PLAN), help="experiment plan TOML (default: the embedded demo)")
    add_plan_overrides(parser)
    parser.add_argument("--out", default=None, help="run directory (default: runs/<plan name>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run directory (--out) from its newest state that verifies")
    parser.add_argument("--elastic", action="store_true",
                        help="with --resume: continue a state saved on another world size, its optimizer state "
                             "repartitioned and its PowerSGD error memory carried over "
                             "(docs/evidence.md#elastic-resume)")
    parser.add_argument("--no_replay", action="store_true",
                        help="train without replay documents or a first cohort's cases (a no-replay control)")
    parser.add_argument("--grown", type=Path, default=None,
                        help="a growth study's upcycled arm: train this grown export of the cohort's accepted "
                             "candidate (python -m nshard.grow) from its weights")
    parser.add_argument("--resolved_ds_config", type=Path, metavar="FILE",
                        help="write the ds_config as this launch hands it to DeepSpeed (batch keys from the plan and "
                             "WORLD_SIZE, \"auto\" values decided on this machine, the \"nshard\" section left out) "
                             "to FILE and exit")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.ds_config = ds_config_path(parser, args)
    return args


def import_error(exc: ImportError) -> str:
    """One line for a package the trainer cannot import: which, why, and the fix."""
    return f"nshard: error: cannot import {exc.name or 'a module'} ({exc}); {IMPORT_FIX}"


def main(argv=None) -> int:
    try:  # every package the run needs, before anything starts: one line naming the missing one
        args = parse_args(argv)
        prepare_process_env()
        from nshard.files import write_json_atomic
        from nshard.log import log
        from nshard.run.data import DataError
        from nshard.seam.ds_config import DsConfigError, load_ds_config, reducer_config
        from nshard.run.plan import PlanError, load_plan
        from nshard.run.start import find_start, grown_start
        from nshard.run.state import find_resumable
        from nshard.run.training import Run, RunError, check_memory, preflight, run_training
        import nshard.analysis.memory_model  # noqa: F401 -- check_memory's, imported where it runs
        import torch.distributed as dist
        import transformers  # noqa: F401 -- the model's and tokenizer's, imported where they load

        from nshard.comm import RanksDisagree
        from nshard.seam.engine import init_distributed, require_deepspeed
        require_deepspeed()  # imported where the engine is built: a missing one is named here, before anything runs
        from nshard.run.receipts import mark
        from nshard.run.device import cuda_available, dist_backend
    except ImportError as exc:
        print(import_error(exc), file=sys.stderr)
        return 2

    try:  # bad input fails here, before any process group, run directory or model exists
        plan_path = plan_with_overrides(args.plan, args.set)  # the plan file itself, or one with the overrides
        plan = load_plan(plan_path)
        if args.resume and args.overwrite:
            raise ValueError(f"--resume continues {args.out or plan.run_dir()} from its newest state and "
                             "--overwrite would erase it: give the same command without --overwrite (launch/demo.sh "
                             "takes --resume in its place: bash launch/demo.sh ds_configs/powersgd.json --resume)")
        if args.elastic and not args.resume:
            raise ValueError("--elastic continues a state on another world size: give it with --resume")
        ds_config = load_ds_config(args.ds_config)
        reducer = reducer_config(ds_config)  # the "nshard" section, parsed once and passed on
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        dist_backend(cuda_available())  # NSHARD_DIST_BACKEND checked before any process group
        given_ds_config, ds_config = ds_config, preflight(plan, ds_config, world_size)  # completed from the plan, once
        if args.resolved_ds_config:
            write_json_atomic(args.resolved_ds_config, ds_config)
            log.info("wrote %s (world size %d); trained nothing", args.resolved_ds_config, world_size)
            return 0
        out = Path(args.out) if args.out else plan.run_dir()
        resume_from = (find_resumable(out, plan_path, Path(args.ds_config), world_size, args.elastic)
                       if args.resume else None)
        start = find_start(plan, world_size) if plan.cohort.enabled else None  # a second cohort's accepted candidate
        if args.grown is not None:
            if start is None or start.kind != "weights":
                raise ValueError("--grown trains a grown export of a cohort's accepted candidate: the plan needs "
                                 "[cohort] with start = \"weights\"")
            start = grown_start(start, args.grown)
        check_memory(plan, given_ds_config, ds_config, world_size, start)  # the predicted peak fits this device
    except (PlanError, DsConfigError, DataError, RunError, OSError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    mark("imports and checks")
    init_distributed()
    mark("process group")
    run = Run(plan, plan_path, Path(args.ds_config), ds_config, out, dist.get_rank(), dist.get_world_size(),
              reducer, start, replay=not args.no_replay)
    try:
        run_training(run, overwrite=args.overwrite, resume_from=resume_from)
        dist.barrier()
        return 0
    except (PlanError, DsConfigError, DataError, RunError, RanksDisagree, OSError) as exc:
        log.error("%s", exc, extra={"rank": run.rank})
        return 2
    finally:  # without it, gloo ranks sometimes abort at exit ("terminate called without an active exception")
        dist.destroy_process_group()


def entry() -> None:
    """`python nshard/train.py` and the nshard-train console script: main(), then the exit below."""
    code = main()
    # Every output is written, flushed and renamed, and the process group is destroyed: leave without the
    # interpreter's finalization, where gloo's and DeepSpeed's C++ threads are torn down and a rank of a complete run
    # was seen to abort ("terminate called without an active exception") on a loaded 2-core machine.
    # MPI's own exit step is one of the skipped ones (mpi4py runs it at exit): without it mpirun reports the rank as
    # terminated abnormally.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
