"""`python -m pivot_hpc.cli.loopback_up CMD…`: bring `lo` up, then exec CMD.

Run first thing inside the fresh network namespace of a local world (`local_world.py`):
a new namespace starts with its loopback interface down, and MPI's launcher needs it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
IFREQ = "16sh22x"  # struct ifreq: name, flags, padding to its 40 bytes


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0))
        flags = struct.unpack(IFREQ, got)[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m pivot_hpc.cli.loopback_up CMD [ARGS…]")
    try:
        loopback_up()
    except OSError as exc:
        raise SystemExit(f"cannot bring up loopback in this network namespace: {exc}") from None
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
