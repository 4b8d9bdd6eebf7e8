"""The TCP sockets a running job listens on, read from /proc (no root, no `ss`)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # "127.0.0.1", "0.0.0.0", "::", …
    port: int
    private_netns: bool  # in a network namespace other than ours that holds only `lo`

    @property
    def loopback(self) -> bool:
        return self.address.startswith("127.") or self.address == "::1"


def _hex_address(text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        packed = b"".join(words)
        ip = ":".join(packed[i : i + 2].hex() for i in range(0, 16, 2))
        ip = {"0000:0000:0000:0000:0000:0000:0000:0000": "::"}.get(ip, ip)
        ip = {"0000:0000:0000:0000:0000:0000:0000:0001": "::1"}.get(ip, ip)
    return ip, int(port, 16)


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


def _private(pid: int) -> bool:
    try:
        ours = os.stat("/proc/self/ns/net").st_ino
        theirs = os.stat(f"/proc/{pid}/ns/net").st_ino
        devs = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    except OSError:
        return False
    names = {line.split(":")[0].strip() for line in devs}
    return theirs != ours and names == {"lo"}


def of_session(sid: int) -> list[Listener]:
    """Every listening TCP socket held by a process of session `sid`."""
    ps = subprocess.run(["ps", "-o", "pid=", "-s", str(sid)], capture_output=True, text=True)
    found = []
    for pid in (int(p) for p in ps.stdout.split()):
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # state LISTEN, held by pid
                    ip, port = _hex_address(cols[1])
                    found.append(Listener(pid, ip, port, _private(pid)))
    return found
