"""One tool call in a short-lived, confined child process.

The child is `python -I -S -c PROLOGUE` (isolated mode, no site-packages), started

- with an empty environment and a fresh private working directory (mkdtemp: mode 0700,
  an unpredictable name; removed afterwards, whatever the child left in it);
- with no inherited file descriptors but three pipes (close_fds; arguments go in on stdin,
  the value comes back on stdout, stderr is read for a short reason only);
- in its own session and process group, which is killed whole (SIGKILL) at the wall-clock
  deadline, on an oversized output, and after every call, so nothing it forked survives;
- in a private network namespace holding only loopback (`unshare --net`), a user
  namespace of its own (`--map-root-user`; for root too, who keeps no capability outside
  it, so that a tool cannot read or write another process's memory through /proc) and,
  where this machine allows them, a private PID namespace (`unshare --pid`) — detected
  once (`detect_isolation`) and reported, never required.

The fixed PROLOGUE clears the environment (Python's own locale coercion sets LC_CTYPE),
makes the child die with the process that spawned it (PR_SET_PDEATHSIG) and unable to
gain privileges by execve (PR_SET_NO_NEW_PRIVS), sets the resource limits (CPU seconds,
address space, open files, file size, no core files, and processes where that cannot
break: see `_nproc_limit`), then runs the tool's program, itself fixed source. In a PID
namespace the tool runs as PID 2 under a minimal init, and a keeper outside the namespace
waits for it and ends the namespace (see `_PROLOGUE`). Model-generated text only ever
reaches the child as data on stdin, after all of this is in place. Doing it in the child
instead of in a `preexec_fn` keeps spawning safe from the server's threads.

Whatever happens — a timeout, a crash, a memory bomb, a flood of output, a failed spawn —
`run_tool` returns a `ToolResult` with a status; it does not raise.
"""

from __future__ import annotations

import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from pivot_hpc.agentic.messages import ToolResult

MAX_PROGRAM_CHARS = 64 * 1024  # one argv string may hold 128 KiB on Linux
MAX_STDIN_BYTES = 64 * 1024  # arguments of one call
STDERR_KEEP_BYTES = 2048  # the tail kept for a crash's reason
PROBE_TIMEOUT_S = 15.0

# Exit statuses the prologue uses (1 is the tools' own "refused, message on stdout").
EXIT_MEMORY = 3  # MemoryError under the address-space limit
EXIT_EXCEPTION = 4  # the tool's program raised (a bug in the tool, not a dead sandbox)
EXIT_PROLOGUE = 5  # the confinement could not be set up (prctl, limits, namespace's init)


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one call (ToolsConfig.sandbox_limits() builds them from the config)."""

    timeout_s: float = 5.0  # wall clock; the process group is killed at it
    cpu_s: int = 2  # RLIMIT_CPU soft limit (SIGXCPU); the hard limit is one second more
    memory_mb: int = 256  # RLIMIT_AS, the interpreter included
    max_files: int = 32  # RLIMIT_NOFILE
    max_processes: int = 4  # RLIMIT_NPROC headroom above the user's current processes
    max_file_mb: int = 1  # RLIMIT_FSIZE: largest file the tool may write in its directory
    max_output_bytes: int = 16 * 1024  # stdout beyond this: status output_limit

    def rlimits(self, extra_processes: int = 0) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) the prologue sets; `extra_processes`: the sandbox's own
        processes besides the tool's (the keeper and init of a PID namespace), so that the
        tool keeps its `max_processes` headroom."""
        mb = 2**20
        limits = [
            (resource.RLIMIT_CPU, self.cpu_s, self.cpu_s + 1),
            (resource.RLIMIT_AS, self.memory_mb * mb, self.memory_mb * mb),
            (resource.RLIMIT_NOFILE, self.max_files, self.max_files),
            (resource.RLIMIT_FSIZE, self.max_file_mb * mb, self.max_file_mb * mb),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        nproc = _nproc_limit(self.max_processes + extra_processes)
        if nproc is not None:
            limits.append((resource.RLIMIT_NPROC, nproc, nproc))
        return limits


def _nproc_limit(headroom: int) -> int | None:
    """RLIMIT_NPROC counts every process of the user, not the child's: a fixed small limit
    would make the child's first fork fail whenever the user already runs that many. So
    the limit is the user's current count plus `headroom`. root is exempt from the limit
    (CAP_SYS_RESOURCE), so none is set there; the deadline's group kill still holds."""
    if os.geteuid() == 0:
        return None
    uid, count = os.getuid(), 0
    try:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    count += entry.stat().st_uid == uid
                except OSError:
                    continue  # exited meanwhile
    except OSError:
        return None
    return count + headroom


# In a PID namespace (`unshare --pid`, without --fork) the prologue's process stays
# outside it, as the call's *keeper*; its first child becomes PID 1 of the namespace, its
# second the tool (PID 2):
#
# - Not the tool as PID 1 (what `unshare --fork` would make it): a namespace's init ignores
#   every signal it has no handler for unless it comes from outside as SIGKILL — a
#   self-sent SIGKILL or SIGSEGV, even RLIMIT_CPU's SIGXCPU, would no longer end the tool,
#   and its own exit status could not say that a signal ended it.
# - The init only waits: it ignores SIGCHLD (orphans it adopts are reaped at once) and
#   reads a pipe whose only writer is the keeper (the tool closes its copy first). When
#   the keeper dies, however it dies, the read ends, the init exits and the kernel
#   SIGKILLs every process left in the namespace: those that left the process group
#   (setsid) included, which the group kill alone would miss.
# - The keeper waits for the tool, then SIGKILLs the init (the namespace is gone once the
#   init is reaped), and ends as the tool did: its exit status, or the signal that ended
#   it, re-raised (core dumps off). So `_reap` sees the tool's status, and the tool's CPU
#   time in the keeper's rusage (the keeper reaped it). A group kill (the deadline, an
#   output flood) takes the keeper with the rest; the init and the tool are then reaped by
#   the machine's reaper (PID 1 or a subreaper), as a tool's own children always were.
#
# PR_SET_PDEATHSIG(SIGKILL) makes the child (the keeper, or the tool without a PID
# namespace) die with the thread that spawned it: `run_tool` blocks that thread until the
# child is reaped, so only the spawning process's death fires it. A parent that died
# before the prctl is caught by comparing getppid() with the spawner's pid, which the
# prologue is given. unshare's --kill-child would not do: it ties PID 1 to unshare, not
# unshare to the server. With the keeper gone, the pipe ends the namespace as above;
# without a PID namespace only the tool's own process dies with the server, and what it
# forked is left to its CPU limit.
_PROLOGUE = """\
import os, resource, signal, sys
os.environ.clear()
try:
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4
    _libc.prctl.restype = ctypes.c_int

    def _prctl(option, value):
        if _libc.prctl(option, value, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(%d) failed" % option)

    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != {parent}:
        os._exit({prologue})  # the spawner died before that: nobody waits for this call
    _prctl(38, 1)  # PR_SET_NO_NEW_PRIVS: no execve gains privileges (set-id bits, file caps)
    for _r, _soft, _hard in {limits!r}:
        _cap = resource.getrlimit(_r)[1]
        if _cap != resource.RLIM_INFINITY:
            _hard = min(_hard, _cap)
            _soft = min(_soft, _hard)
        resource.setrlimit(_r, (_soft, _hard))
    if {pid_namespace}:
        _rfd, _wfd = os.pipe()
        _init = os.fork()
        if _init == 0:  # PID 1 of the namespace
            try:
                os.close(_wfd)
                os.closerange(0, 3)
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # as PID 1: deaf from inside
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)
                while os.read(_rfd, 1):
                    pass
            finally:
                os._exit(0)
        os.close(_rfd)
        _tool = os.fork()
        if _tool:  # the keeper
            os.closerange(0, 3)
            _status = os.waitpid(_tool, 0)[1]
            os.kill(_init, signal.SIGKILL)
            os.waitpid(_init, 0)
            if os.WIFEXITED(_status):
                os._exit(os.WEXITSTATUS(_status))
            _sig = os.WTERMSIG(_status)
            _prctl(4, 0)  # PR_SET_DUMPABLE: no core dump of the keeper
            if _sig != signal.SIGKILL:
                signal.signal(_sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [_sig])
            os.kill(os.getpid(), _sig)
            os._exit(128 + _sig)
        os.close(_wfd)
except BaseException as _exc:
    try:
        os.write(2, ("%s: %s" % (type(_exc).__name__, _exc)).encode())
    finally:
        os._exit({prologue})
try:
    exec(compile({program!r}, "<tool>", "exec"), {{"__name__": "__main__"}})
except MemoryError:
    os._exit({memory})
except SystemExit:
    raise
except BaseException as _exc:
    os.write(2, type(_exc).__name__.encode())
    os._exit({exception})
"""


def prologue(
    program: str, limits: SandboxLimits, *, pid_namespace: bool = False, parent: int | None = None
) -> str:
    """The `-c` program of the child: confine itself, set the limits, then run `program`.
    `pid_namespace`: the child was started by `unshare --pid` (see above); `parent`: the pid
    of the process that spawns it (this one when None)."""
    return _PROLOGUE.format(
        limits=limits.rlimits(2 if pid_namespace else 0),
        program=program,
        pid_namespace=bool(pid_namespace),
        parent=os.getpid() if parent is None else int(parent),
        prologue=EXIT_PROLOGUE,
        memory=EXIT_MEMORY,
        exception=EXIT_EXCEPTION,
    )


# ------------------------------------------------------------------ namespaces
@dataclass(frozen=True, slots=True)
class Isolation:
    """How children are confined beyond rlimits: `network` is True when they run in a
    private network namespace (only loopback) through `prefix`, `pid_namespace` when in a
    private PID namespace too; `detail` says which, or why not, in one line."""

    network: bool
    prefix: tuple[str, ...]
    detail: str
    pid_namespace: bool = False


_isolation: Isolation | None = None
_isolation_lock = threading.Lock()


def detect_isolation(refresh: bool = False) -> Isolation:
    """Probe once per process whether `unshare --net --pid` or else `unshare --net` (with
    --map-root-user when not root) gives a child a network namespace with nothing but
    loopback and, with --pid, a PID namespace whose first process is PID 1. Never raises."""
    global _isolation
    with _isolation_lock:
        if _isolation is None or refresh:
            _isolation = _probe_isolation()
        return _isolation


def no_isolation(why: str) -> Isolation:
    return Isolation(False, (), why)


# What the probe's child sees: its network interfaces, and whether its first child is PID 1
# (unshare --pid without --fork leaves the caller outside; its children go in).
_PROBE = """\
import os
names = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]
child = os.fork()
if child == 0:
    os._exit(0 if os.getpid() == 1 else 1)
print(' '.join(names), 'pid1' if os.waitpid(child, 0)[1] == 0 else 'no-pid1')
"""


def _probe_isolation() -> Isolation:
    unshare = shutil.which("unshare")
    if unshare is None:
        return no_isolation("no network isolation: unshare(1) not found (util-linux)")
    # A user namespace first, for root too: root mapped to itself in a namespace of its own
    # keeps no capability outside it, so a tool cannot open another process's memory or
    # environment (/proc/PID/mem, /proc/PID/environ), which root otherwise can. Only a
    # user namespace lets a non-root user unshare at all.
    users = [["--map-root-user"], []] if os.geteuid() == 0 else [["--map-root-user"]]
    why = {True: "failed", False: "failed"}
    for pid in (True, False):
        for user in users:
            cmd = [unshare, "--net", *(["--pid"] if pid else []), *user]
            net_ok, pid_ok, why[pid] = _probe(cmd)
            if net_ok and (pid_ok or not pid):
                used = " ".join(cmd)
                root = "" if user else "; no user namespace: a tool keeps root's powers"
                if pid:
                    detail = f"private network and PID namespaces ({used}){root}"
                    return Isolation(True, tuple(cmd), detail, True)
                detail = f"private network namespace ({used}); no PID namespace ({why[True]})"
                return Isolation(True, tuple(cmd), detail + root)
    return no_isolation(f"no network isolation: unshare --net is not permitted here ({why[False]})")


def _probe(cmd: list[str]) -> tuple[bool, bool, str]:
    """Run the probe under `cmd`: (only loopback, first child was PID 1, why not)."""
    try:
        out = subprocess.run(
            [*cmd, sys.executable, "-I", "-S", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env={},
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, False, f"{type(exc).__name__}: {exc}"
    words = out.stdout.split()
    interfaces, pid1 = set(words[:-1]), words[-1:] == ["pid1"]
    net_ok = out.returncode == 0 and interfaces == {"lo"}
    if net_ok and pid1:
        return True, True, ""
    lines = out.stderr.strip().splitlines()
    if lines:
        why = lines[-1]
    elif not net_ok:
        why = f"interfaces {sorted(interfaces)}"
    else:
        why = "its first child was not PID 1"
    return net_ok, pid1, why


# ------------------------------------------------------------------ one call
def run_tool(
    program: str,
    stdin: bytes,
    limits: SandboxLimits,
    *,
    call_id: int = 0,
    isolation: Isolation | None = None,
    workdir_root: str | None = None,
) -> ToolResult:
    """Run `program` on `stdin` in a fresh confined child; the outcome as a ToolResult.
    `isolation`: detect_isolation() when None (pass no_isolation(...) to skip it);
    `workdir_root`: where the private working directory is made (the temp dir when None)."""
    start = time.monotonic()
    if len(program) > MAX_PROGRAM_CHARS or len(stdin) > MAX_STDIN_BYTES:
        return ToolResult(call_id, "error", "arguments too long", 0.0)
    iso = detect_isolation() if isolation is None else isolation
    try:
        workdir = tempfile.mkdtemp(prefix="pivot-tool-", dir=workdir_root)
    except OSError as exc:
        return ToolResult(call_id, "unavailable", f"no working directory ({exc})", 0.0)
    try:
        status, text = _run_in(workdir, program, stdin, limits, iso, start)
    finally:
        remove_tree(workdir)
    return ToolResult(call_id, status, text, round(time.monotonic() - start, 6))


def _run_in(
    workdir: str,
    program: str,
    stdin: bytes,
    limits: SandboxLimits,
    iso: Isolation,
    start: float,
) -> tuple[str, str]:
    code = prologue(program, limits, pid_namespace=iso.pid_namespace)
    argv = [*iso.prefix, sys.executable, "-I", "-S", "-c", code]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={},
            close_fds=True,
            start_new_session=True,  # its own session and process group, id = its pid
        )
    except OSError as exc:
        return "unavailable", f"the sandbox could not start a process ({exc.strerror or exc})"
    deadline = start + limits.timeout_s
    try:
        killed, out, err = _exchange(proc, stdin, limits, deadline)
    finally:
        _kill_group(proc.pid)
        status, rusage = _reap(proc)
    return _classify(killed, status, rusage, out, err, limits)


def _exchange(
    proc: subprocess.Popen, stdin: bytes, limits: SandboxLimits, deadline: float
) -> tuple[str | None, bytes, bytes]:
    """Feed stdin, collect stdout/stderr until the child exits; kill its group at the
    deadline or on too much output. (why it was killed or None, stdout, stderr tail)"""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    pending = memoryview(stdin)
    sel = selectors.DefaultSelector()
    try:
        for f in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
        if pending:
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        exited = False
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout", bytes(out), bytes(err)
            for key, _ in sel.select(timeout=min(remaining, 0.05)):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        pending = pending[os.write(proc.stdin.fileno(), pending) :]
                    except BrokenPipeError:
                        pending = pending[:0]  # the child does not read it all: fine
                    if not pending:
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    continue
                if f is proc.stdout:
                    out += chunk
                    if len(out) > limits.max_output_bytes:
                        return "output_limit", bytes(out), bytes(err)
                else:
                    err = (err + chunk)[-STDERR_KEEP_BYTES:]
            if not exited and _has_exited(proc.pid):
                # Leftovers of its group may still hold the pipes open: end them now so
                # the pipes close and the loop ends without waiting for the deadline.
                exited = True
                _kill_group(proc.pid)
        while not _has_exited(proc.pid):  # pipes closed early; the exit follows
            if time.monotonic() >= deadline:
                return "timeout", bytes(out), bytes(err)
            time.sleep(0.002)
        return None, bytes(out), bytes(err)
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: a zombie leader keeps its process
    group id from being reused until the group has been killed."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left of it


def _reap(proc: subprocess.Popen) -> tuple[int | None, resource.struct_rusage | None]:
    """Reap the killed-or-exited leader: (its wait status, its resource usage)."""
    try:
        _, status, rusage = os.wait4(proc.pid, 0)
    except ChildProcessError:
        proc.wait()
        return None, None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return status, rusage


def _classify(
    killed: str | None,
    status: int | None,
    rusage: resource.struct_rusage | None,
    out: bytes,
    err: bytes,
    limits: SandboxLimits,
) -> tuple[str, str]:
    text = out.decode("utf-8", errors="replace").strip()
    if killed == "timeout":
        return "timeout", f"timed out after {limits.timeout_s:g} s"
    if killed == "output_limit":
        return "output_limit", f"output longer than {limits.max_output_bytes} bytes"
    if status is None:
        return "crash", "the sandbox lost its child"
    code = os.waitstatus_to_exitcode(status)
    cpu = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
    if code == 0:
        return "ok", text
    if code == 1 and text:
        return "error", text
    if code == EXIT_MEMORY:
        return "memory", f"memory limit ({limits.memory_mb} MB) reached"
    if code == EXIT_EXCEPTION:
        return "error", f"the tool failed ({_tail(err)})"
    if code == EXIT_PROLOGUE:
        return "crash", f"the sandbox could not confine the call ({_tail(err)})"
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= limits.cpu_s):
        return "timeout", f"CPU time limit ({limits.cpu_s} s) reached"
    if code < 0:
        return "crash", f"killed by {signal.Signals(-code).name}"
    return "crash", f"exit status {code}" + (f" ({_tail(err)})" if err.strip() else "")


def _tail(err: bytes) -> str:
    lines = err.decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1][-200:] if lines else "no message"


def remove_tree(path: str) -> None:
    """Remove a working directory whatever the child did to it (a directory left without
    permissions, for one); never raises."""

    def unlock(func, p, _exc) -> None:  # type: ignore[no-untyped-def]
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=unlock)
