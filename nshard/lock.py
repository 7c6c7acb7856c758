"""One run owns its output directory: a lock file beside it (`PARENT/.NAME.lock`), held with flock by one process
for the run's life, naming its holder (pid, host, start); a second run on the same directory is refused, a killed
holder's lock is taken over.

The rule (docs/evidence.md#who-owns-a-directory):
- the lock is the kernel's flock on the lock file: a holder that exits, or is killed, loses it at once;
- the file says who holds it (JSON: pid, host, boot_id, started_at, command) and is removed on a clean exit, so a
  file found with a record in it was left by a holder that was killed: it is taken over, with a line saying so;
- flock may not reach across hosts on every shared filesystem, so the holder touches the file every HEARTBEAT_S: a
  record of another host (another boot_id) whose heartbeat is younger than STALE_S refuses even when flock is
  granted here.
The lock sits beside the directory, not in it, so a refused run writes nothing there, and `--overwrite` (which
replaces the directory) cannot remove it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Callable

HEARTBEAT_S = 10.0
"""How often the holder touches its lock file (its mtime is the heartbeat other hosts read)."""
STALE_S = 60.0
"""A lock of another host whose heartbeat is older than this is taken over."""


class LockError(RuntimeError):
    """The directory is owned by another run; the message names the holder and what to do."""


def lock_path(out: Path) -> Path:
    out = Path(out).resolve()
    return out.parent / f".{out.name}.lock"


def boot_id() -> str:
    """This machine's boot (pids and flock are only comparable within one); the host name where Linux has none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def holder_line(record: dict) -> str:
    if not record.get("pid"):
        return "another process (its record is not written yet)"
    return f"pid {record['pid']} on host {record.get('host')} (started {record.get('started_at')})"


class DirLock:
    """A held lock; release() (or leaving the `with` block) removes the file and the folders made for it."""

    def __init__(self, path: Path, fd: int, made: list[Path], took_over: dict | None):
        self.path, self.fd, self.made, self.took_over = path, fd, made, took_over
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="nshard-lock-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.fd)
            except OSError:  # a heartbeat missed is not worth stopping the run for
                pass

    def release(self) -> None:
        if self.fd is None:
            return
        self._stop.set()
        self._beat.join()
        try:
            if same_file(self.fd, self.path):
                self.path.unlink()  # while still held: a waiter that opened it sees another file and retries
        finally:
            os.close(self.fd)
            self.fd = None
            remove_made(self.made)

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def make_parents(folder: Path) -> list[Path]:
    """mkdir -p, returning the folders it made, innermost first (removed again when the lock is released)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
    return missing


def remove_made(made: list[Path]) -> None:
    for path in made:  # innermost first; one that now holds something stays
        try:
            path.rmdir()
        except OSError:
            break


def read_record(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def acquire(out: Path, note: Callable[[str], None] = print) -> DirLock:
    """Own `out` (which need not exist yet), or LockError naming its holder. A stale lock is taken over and
    `note` says so."""
    out = Path(out).resolve()
    path = lock_path(out)
    made = make_parents(path.parent)
    try:
        fd = _open_locked(path, out)
        try:
            stale = read_record(fd)
            _refuse_live_other_host(fd, stale, path, out)
            mine = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(), "out": str(out),
                    "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(sys.argv)[:400]}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(mine, indent=1) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        remove_made(made)
        raise
    if stale.get("pid"):
        note(f"taking over the stale lock {path} of {holder_line(stale)}: {gone(stale)}")
    return DirLock(path, fd, made, stale or None)


def _open_locked(path: Path, out: Path) -> int:
    for _ in range(10):
        fd = _open_own_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = read_record(fd)
            os.close(fd)
            raise LockError(f"{out} is in use by {holder_line(record)} (lock {path}); wait for that run to "
                            "finish, or give another --out") from None
        except BaseException:
            os.close(fd)
            raise
        if same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: take the new one
    raise LockError(f"could not take the lock {path}: it kept being replaced; is another run starting on {out}?")


def _open_own_file(path: Path) -> int:
    """Open (or create) the lock file itself, never what a link there points at: the holder truncates and writes
    it, so a link planted in a shared runs folder would have a run overwrite any file its user may write."""
    fix = f"remove it (rm {path}) if no run of yours is using that --out, and start again"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockError(f"the lock file {path} is a symbolic link (to {os.readlink(path)}); nshard does not "
                            f"write through links: {fix}") from None
        raise LockError(f"cannot open the lock file {path}: {exc.strerror}; {fix}") from None
    st = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})" if st.st_uid != os.geteuid() else
               f"has {st.st_nlink} hard links (another name shares its contents)" if st.st_nlink != 1 else None)
    if problem:
        os.close(fd)
        raise LockError(f"the lock file {path} {problem}; nshard does not write to it: {fix}")
    return fd


def _refuse_live_other_host(fd: int, record: dict, path: Path, out: Path) -> None:
    """flock was granted, but a record of another machine may be a holder that flock here cannot see."""
    if not record.get("pid") or record.get("boot_id") == boot_id():
        return
    age = time.time() - os.fstat(fd).st_mtime
    if age < STALE_S:
        raise LockError(f"{out} is in use by {holder_line(record)} (lock {path}, its heartbeat {age:.0f} s old; "
                        f"flock may not reach that host): wait for that run to finish, or give another --out; a lock "
                        f"whose heartbeat is {STALE_S:.0f} s old is taken over")


def gone(record: dict) -> str:
    if record.get("boot_id") != boot_id():
        return "its heartbeat stopped"
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return "that process is gone"
    except (OSError, ValueError):
        pass
    return "it no longer holds the lock"
