"""Check a DeepSpeed hostfile ("HOST slots=N" per line, # comments) before the launcher reads it.

    python -m nshard.run.hostfile hostfile      # exit 0 and print the hosts, or one error naming the line
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from nshard.log import log

LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*(#.*)?$")


class HostfileError(ValueError):
    pass


def parse_hostfile(path: str | Path) -> dict[str, int]:
    path = Path(path)
    if not path.is_file():
        raise HostfileError(f"hostfile {path} does not exist: write one line 'HOST slots=N' per host")
    hosts: dict[str, int] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise HostfileError(f"{path}:{lineno}: {raw!r} does not parse; each line must be 'HOST slots=N', "
                                "e.g. 'localhost slots=2'")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise HostfileError(f"{path}:{lineno}: slots={slots}; a host needs at least one slot")
        if host in hosts:
            raise HostfileError(f"{path}:{lineno}: host {host} is listed twice; list each host once")
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no host: add a line such as 'localhost slots=2'")
    return hosts


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        hosts = parse_hostfile(args[0] if args else "hostfile")
    except HostfileError as exc:
        log.error("%s", exc)
        return 2
    print(" ".join(f"{h}:{n}" for h, n in hosts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
