"""nshard's logger, `logging.getLogger("nshard")`: the "nshard: ..." lines a run prints.

Rank 0 logs at NSHARD_LOG_LEVEL (default info), every other rank only warnings and errors, as DeepSpeed's
`log_dist(..., ranks=[0])` does; NSHARD_LOG_RANKS=all (or a list, 0,1) gives those ranks the full level. The levels
are DeepSpeed's `--log_level` names (debug, info, warning, error, critical). Status lines go to stdout, warnings and
errors to stderr, each as "nshard: [warning|error[ (rank N)]: ]message". Machine-readable output (JSON records, a
tool's report) is printed, not logged.
"""

from __future__ import annotations

import logging
import os
import sys

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
          "critical": logging.CRITICAL}
TAGS = {logging.WARNING: "warning", logging.ERROR: "error", logging.CRITICAL: "error"}

log = logging.getLogger("nshard")


def process_rank() -> int:
    """This process's rank as its launcher set it (deepspeed, torchrun: RANK; mpirun: OMPI_COMM_WORLD_RANK); 0 alone."""
    return int(os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        tag = TAGS.get(record.levelno, "")
        if tag and getattr(record, "rank", None) is not None:  # log.error(..., extra={"rank": r})
            tag += f" (rank {record.rank})"
        return f"nshard: {tag + ': ' if tag else ''}{record.getMessage()}"


class _Streams(logging.StreamHandler):
    """Info and below to stdout, warnings and errors to stderr; each looked up per line, so a redirected stream
    (pytest's capsys, contextlib.redirect_stderr) receives it."""

    def emit(self, record: logging.LogRecord) -> None:
        # Not setStream: it flushes the stream it replaces, which a test's capture may have closed.
        self.stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        super().emit(record)


class _Ranks(logging.Filter):
    def __init__(self, ranks: set[int] | None):
        super().__init__()
        self.ranks = ranks  # None: every rank

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or self.ranks is None or process_rank() in self.ranks


def configure(environ=os.environ) -> None:
    """Set the logger from NSHARD_LOG_LEVEL and NSHARD_LOG_RANKS (done once at import; again in tests)."""
    name = environ.get("NSHARD_LOG_LEVEL", "info").strip().lower()
    ranks_spec = environ.get("NSHARD_LOG_RANKS", "0").strip().lower()
    problems = []
    if name not in LEVELS:
        problems.append(f"NSHARD_LOG_LEVEL={name!r} is not a level; use one of {', '.join(LEVELS)}; logging at info")
        name = "info"
    try:
        ranks = None if ranks_spec == "all" else {int(r) for r in ranks_spec.split(",")}
    except ValueError:
        problems.append(f"NSHARD_LOG_RANKS={ranks_spec!r} is not 'all' or a list of ranks such as 0,1; logging on "
                        "rank 0")
        ranks = {0}
    for handler in [h for h in log.handlers if isinstance(h, _Streams)]:
        log.removeHandler(handler)
    handler = _Streams()
    handler.setFormatter(_Format())
    handler.addFilter(_Ranks(ranks))
    log.addHandler(handler)
    log.setLevel(LEVELS[name])
    log.propagate = False  # one line per message, whatever the root logger does
    for problem in problems:
        log.warning("%s", problem)


configure()
