"""The tool sandbox: limits, deadlines, a clean child, the whole process group killed, the
PID namespace, the call's death with its spawner, no_new_privs; and the node's sandbox
server (bounded concurrency, health). Every test spawns short-lived children and carries a
timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from pivot_hpc.agentic import sandbox
from pivot_hpc.agentic.messages import ToolCall
from pivot_hpc.agentic.sandbox import Isolation, SandboxLimits, detect_isolation, run_tool
from pivot_hpc.agentic.server import SandboxServer, preflight
from pivot_hpc.agentic.tools import (
    CALCULATOR_SCHEMA,
    ToolRegistry,
    ToolSpec,
    build_registry,
    calculator,
    observation_body,
)

# A killed group is reaped and its directory removed within this; generous, since the test
# machine's 2 cores are shared (a load of 10 was seen): the point is minutes vs seconds.
GRACE_S = 2.5
REPO = Path(__file__).resolve().parents[2]
NO_ISOLATION = sandbox.no_isolation("turned off by the test")


def calc(expression: str, limits: SandboxLimits | None = None):
    payload = json.dumps({"expression": expression}).encode()
    return run_tool(calculator().program, payload, limits or SandboxLimits())


def _alive(marker: str) -> list[int]:
    """Processes (not zombies) whose command line holds `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "cmdline").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


def _gone(marker: str, within_s: float = GRACE_S) -> bool:
    end = time.monotonic() + within_s
    while _alive(marker):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _forks_sleeper(marker: str, then: str, setsid: bool = False) -> str:
    """A program that leaves a grandchild sleeping (named by `marker`; with `setsid`, in a
    session and process group of its own, out of reach of the group kill), then runs
    `then`."""
    return (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        + ("    os.setsid()\n" if setsid else "")
        + f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        f"{then}\n"
    )


def _kill_leftovers(marker: str) -> None:
    for pid in _alive(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _run_watching(
    program: str, limits: SandboxLimits, marker: str, isolation: Isolation | None = None
):
    """Run `program`; check its grandchild really started; (result, wall seconds)."""
    box: list = []
    start = time.monotonic()
    worker = threading.Thread(
        target=lambda: box.append(run_tool(program, b"", limits, isolation=isolation))
    )
    worker.start()
    seen = False
    while worker.is_alive() and not seen:
        seen = bool(_alive(marker))
        time.sleep(0.02)
    worker.join()
    assert seen, "the grandchild never started: the test would prove nothing"
    return box[0], time.monotonic() - start


@pytest.mark.timeout(30)
def test_calculator_runs_in_the_sandbox():
    result = calc("47+38+96")
    assert (result.status, result.text) == ("ok", "181")
    refused = calc("__import__('os').system('touch /tmp/pwned')")
    assert refused.status == "error" and "not allowed" in refused.text
    assert calc("9**9**9").status == "error"
    assert observation_body(calc("1/0")) == "error: division by zero"


@pytest.mark.timeout(30)
def test_cpu_spin_is_killed_with_its_process_group():
    marker = f"pivot-test-{uuid.uuid4().hex}"
    limits = SandboxLimits(timeout_s=2.0, cpu_s=1)
    result, wall = _run_watching(_forks_sleeper(marker, "while True: pass"), limits, marker)
    assert result.status == "timeout", result
    assert wall < limits.timeout_s + GRACE_S
    assert _gone(marker), "a process of the group outlived the call"


@pytest.mark.timeout(30)
def test_memory_bomb_is_stopped_with_its_process_group():
    marker = f"pivot-test-{uuid.uuid4().hex}"
    bomb = "x = []\nwhile True:\n    x.append(bytearray(1 << 24))"
    limits = SandboxLimits(timeout_s=5.0, memory_mb=128)
    result, wall = _run_watching(_forks_sleeper(marker, bomb), limits, marker)
    assert result.status == "memory", result
    assert wall < limits.timeout_s + GRACE_S
    assert _gone(marker)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("isolation", [None, NO_ISOLATION], ids=["detected", "none"])
def test_wall_deadline_kills_a_sleeping_group(isolation):
    marker = f"pivot-test-{uuid.uuid4().hex}"
    limits = SandboxLimits(timeout_s=0.8)
    program = _forks_sleeper(marker, "import time; time.sleep(60)")
    result, wall = _run_watching(program, limits, marker, isolation)
    assert result.status == "timeout" and "0.8" in result.text
    assert wall < limits.timeout_s + GRACE_S
    assert _gone(marker)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("isolation", [None, NO_ISOLATION], ids=["detected", "none"])
def test_leftovers_of_a_call_that_exited_are_killed(isolation):
    marker = f"pivot-test-{uuid.uuid4().hex}"
    program = _forks_sleeper(marker, "import time; time.sleep(0.3); print('done')")
    result, _ = _run_watching(program, SandboxLimits(timeout_s=5.0), marker, isolation)
    assert (result.status, result.text) == ("ok", "done")  # not a timeout: the grandchild
    assert result.seconds < 5.0  # holding stdout open did not keep the call waiting
    assert _gone(marker)


# `host`: its own /proc/self/stat, which (the machine's /proc, not the namespace's) gives
# the ids as the server sees them.
CHILD_REPORT = r"""
import json, os
stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
fds = []
for fd in range(3, 64):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
print(json.dumps({
    "environ": open("/proc/self/environ", "rb").read().decode(),
    "os_environ": dict(os.environ),
    "fds": fds,
    "cwd": os.getcwd(),
    "cwd_mode": os.stat(".").st_mode & 0o777,
    "cwd_entries": os.listdir("."),
    "host": {"pid": int(os.readlink("/proc/self")), "ppid": int(stat[1]),
             "pgrp": int(stat[2]), "session": int(stat[3])},
}))
"""


@pytest.mark.timeout(30)
def test_child_has_empty_environment_no_fds_and_private_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PIVOT_TEST_SECRET", "hunter2")
    leaked = os.open(os.devnull, os.O_RDONLY)
    os.set_inheritable(leaked, True)  # even an inheritable descriptor must not reach it
    try:
        result = run_tool(CHILD_REPORT, b"", SandboxLimits(), workdir_root=str(tmp_path))
    finally:
        os.close(leaked)
    assert result.status == "ok", result
    report = json.loads(result.text)
    assert report["environ"] == "" and report["os_environ"] == {}
    assert report["fds"] == []
    assert report["cwd_mode"] == 0o700 and report["cwd_entries"] == []
    # Its own session and process group, whose leader is the child the server spawned:
    # the tool itself, or in a PID namespace its keeper, outside the namespace.
    host = report["host"]
    leader = host["ppid"] if detect_isolation().pid_namespace else host["pid"]
    assert host["pgrp"] == host["session"] == leader
    assert Path(report["cwd"]).parent == tmp_path
    assert list(tmp_path.iterdir()) == []  # the working directory was removed


@pytest.mark.timeout(30)
def test_working_directory_is_removed_whatever_the_child_left(tmp_path):
    program = "import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a', 0)\n"
    result = run_tool(program, b"", SandboxLimits(), workdir_root=str(tmp_path))
    assert result.status == "ok", result
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("program", "status", "text"),
    [
        ("import sys\nwhile True: sys.stdout.write('x' * 65536)", "output_limit", "output"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "crash", "SIGSEGV"),
        ("import sys\nsys.exit(7)", "crash", "exit status 7"),
        ("raise KeyError('boom')", "error", "KeyError"),
        ("import sys\nprint('error: bad input')\nsys.exit(1)", "error", "bad input"),
        ("open('big', 'wb').write(b'x' * (2 << 20))", "error", "the tool failed"),  # FSIZE
    ],
)
def test_failures_become_statuses(program, status, text):
    result = run_tool(program, b"", SandboxLimits(timeout_s=5.0))
    assert result.status == status and text in result.text, result


@pytest.mark.timeout(30)
def test_network_isolation_when_available():
    iso = detect_isolation()
    assert iso is detect_isolation()  # probed once
    if not iso.network:
        pytest.skip(iso.detail)
    program = (
        "import socket\n"
        "names = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
        "try:\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
        "    net = 'reachable'\n"
        "except OSError:\n"
        "    net = 'unreachable'\n"
        "print(' '.join(names), net)\n"
    )
    result = run_tool(program, b"", SandboxLimits(), isolation=iso)
    assert (result.status, result.text) == ("ok", "lo unreachable")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("isolation", [None, NO_ISOLATION], ids=["detected", "none"])
def test_cpu_limit_is_reported_as_such(isolation):
    """RLIMIT_CPU's SIGXCPU ends the tool (in a PID namespace too: the tool is not its
    init, which would ignore it), and the status says so."""
    limits = SandboxLimits(timeout_s=30.0, cpu_s=1)
    result = run_tool("while True: pass", b"", limits, isolation=isolation)
    assert result.status == "timeout" and "CPU time limit (1 s)" in result.text, result


PID_REPORT = r"""
import json, os, signal, sys
server = int(sys.stdin.read())
os.kill(1, signal.SIGKILL)  # a namespace's init is deaf to its own namespace: ignored
seen = []
for pid in [*range(1, 4096), server]:
    try:
        os.kill(pid, 0)
        seen.append(pid)
    except ProcessLookupError:
        pass
child = os.fork()
if child == 0:
    os._exit(os.getpid())
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "seen": seen,
                  "child": os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])}))
"""


@pytest.mark.timeout(30)
def test_tool_runs_in_a_fresh_pid_namespace_when_available():
    iso = detect_isolation()
    if not iso.pid_namespace:
        pytest.skip(iso.detail)
    result = run_tool(PID_REPORT, str(os.getpid()).encode(), SandboxLimits(), isolation=iso)
    assert result.status == "ok", result
    report = json.loads(result.text)
    # PID 2 under the namespace's init (PID 1); its parent, the keeper, lies outside (0);
    # no other process of the machine, this one included, can be named from in there.
    assert (report["pid"], report["ppid"], report["seen"]) == (2, 0, [1, 2]), report
    assert report["child"] == 3


@pytest.mark.timeout(30)
def test_a_process_that_left_the_group_dies_with_the_namespace():
    iso = detect_isolation()
    if not iso.pid_namespace:
        pytest.skip(iso.detail)
    marker = f"pivot-test-{uuid.uuid4().hex}"
    program = _forks_sleeper(marker, "import time; time.sleep(0.3); print('done')", setsid=True)
    try:
        result, _ = _run_watching(program, SandboxLimits(timeout_s=5.0), marker, iso)
        assert (result.status, result.text) == ("ok", "done")
        assert _gone(marker), "a process that called setsid() outlived the call"
    finally:
        _kill_leftovers(marker)


NO_NEW_PRIVS = r"""
for line in open("/proc/self/status"):
    if line.startswith("NoNewPrivs:"):
        print(line.split()[1])
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("isolation", [None, NO_ISOLATION], ids=["detected", "none"])
def test_tool_cannot_gain_privileges(isolation):
    result = run_tool(NO_NEW_PRIVS, b"", SandboxLimits(), isolation=isolation)
    assert (result.status, result.text) == ("ok", "1"), result


# Runs one spinning call (which, in a PID namespace, first forks a sleeper) in a process of
# its own, the test's stand-in for a sandbox service; the tool makes the file `started`
# once it runs. argv: marker, "detected" or "none", started.
SPAWNER = r"""
import sys
from pivot_hpc.agentic.sandbox import SandboxLimits, detect_isolation, no_isolation, run_tool
marker, mode, started = sys.argv[1:4]
iso = detect_isolation() if mode == "detected" else no_isolation("off")
sleeper = (
    "import os, sys\n"
    "if os.fork() == 0:\n"
    "    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
    f"{marker + '-sleeper'!r}])\n"
)
spin = f"# {marker}\nopen({started!r}, 'w').close()\nwhile True: pass\n"
program = sleeper + spin if iso.pid_namespace else spin
run_tool(program, b"", SandboxLimits(timeout_s=60.0, cpu_s=60), isolation=iso)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["detected", "none"])
def test_call_dies_with_the_process_that_spawned_it(mode, tmp_path):
    """A sandbox service killed with SIGKILL leaves no process of its call behind: the
    call's child dies with it (PR_SET_PDEATHSIG), and with it, in a PID namespace, the
    namespace and all that the tool forked."""
    marker, started = f"pivot-test-{uuid.uuid4().hex}", tmp_path / "started"
    spawner = subprocess.Popen(
        [sys.executable, "-c", SPAWNER, marker, mode, str(started)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        end = time.monotonic() + 30.0
        while not started.exists():  # the tool runs (and has forked its sleeper)
            assert spawner.poll() is None, "the spawner ended early"
            assert time.monotonic() < end, "the call never started"
            time.sleep(0.02)
        assert [p for p in _alive(marker) if p != spawner.pid], "no process of the call seen"
        spawner.send_signal(signal.SIGKILL)
        spawner.wait(timeout=10)
        assert _gone(marker), f"processes of the call outlived their spawner: {_alive(marker)}"
    finally:
        spawner.kill()
        spawner.wait(timeout=10)
        _kill_leftovers(marker)


def test_probe_falls_back_to_the_network_namespace_alone(monkeypatch):
    """Where --pid is refused, the network namespace is still used, and the reason given."""
    monkeypatch.setattr(sandbox.shutil, "which", lambda _name: "/usr/bin/unshare")
    monkeypatch.setattr(
        sandbox,
        "_probe",
        lambda cmd: (
            (True, False, "unshare: unshare failed: Operation not permitted")
            if "--pid" in cmd
            else (True, False, "its first child was not PID 1")
        ),
    )
    iso = sandbox._probe_isolation()
    assert iso.network and not iso.pid_namespace and "--pid" not in iso.prefix
    assert "no PID namespace (unshare: unshare failed" in iso.detail, iso.detail
    monkeypatch.setattr(sandbox, "_probe", lambda cmd: (False, False, "not permitted"))
    iso = sandbox._probe_isolation()
    assert (iso.network, iso.pid_namespace, iso.prefix) == (False, False, ())
    assert "not permitted" in iso.detail


@pytest.mark.timeout(30)
def test_without_isolation_it_still_runs():
    result = run_tool(
        "print(6 * 7)", b"", SandboxLimits(), isolation=sandbox.no_isolation("turned off")
    )
    assert (result.status, result.text) == ("ok", "42")


# ---------------------------------------------------------------------- the node's server
def _tool(name: str, program: str) -> ToolSpec:
    return ToolSpec(name=name, description=name, parameters=CALCULATOR_SCHEMA, program=program)


@pytest.mark.timeout(30)
def test_server_runs_calls_with_bounded_concurrency():
    registry = ToolRegistry([calculator(), _tool("nap", "import time; time.sleep(0.4)")])
    with SandboxServer(registry, SandboxLimits(), max_concurrent=2) as server:
        start = time.monotonic()
        for i in range(4):
            server.submit(ToolCall(i, i, "nap", '{"expression": "1"}', 5.0))
        server.submit(ToolCall(9, 9, "calculator", '{"expression": "47+38+96"}', 5.0))
        server.submit(ToolCall(10, 9, "shell", "{}", 5.0))  # not declared: no child
        server.submit(ToolCall(11, 9, "calculator", '{"expr": 1}', 5.0))  # schema
        results = {}
        while len(results) < 7:
            results.update({r.call_id: r for r in server.poll()})
            time.sleep(0.01)
        wall = time.monotonic() - start
        assert server.outstanding == 0
    assert all(results[i].status == "ok" for i in range(4))
    assert wall >= 0.8  # four 0.4 s naps, two at a time
    assert (results[9].status, results[9].text) == ("ok", "181")
    assert results[10].status == "error" and "unknown tool" in results[10].text
    assert results[11].status == "error" and "missing required" in results[11].text


@pytest.mark.timeout(30)
def test_call_deadline_shortens_the_limit():
    registry = ToolRegistry([_tool("nap", "import time; time.sleep(5)")])
    with SandboxServer(registry, SandboxLimits(timeout_s=10.0)) as server:
        result = server.call(ToolCall(1, 1, "nap", '{"expression": "1"}', 0.3))
    assert result.status == "timeout" and result.seconds < 0.3 + GRACE_S


@pytest.mark.timeout(30)
def test_repeated_sandbox_deaths_mark_the_node_unhealthy_once():
    lines: list[str] = []
    registry = ToolRegistry(
        [_tool("dies", "import os\nos.kill(os.getpid(), 9)"), _tool("fine", "print(1)")]
    )
    args = '{"expression": "1"}'
    with SandboxServer(
        registry, SandboxLimits(), unhealthy_after_failures=2, node=3, notify=lines.append
    ) as server:
        assert server.call(ToolCall(1, 1, "dies", args, 5.0)).status == "crash"
        assert server.call(ToolCall(2, 1, "fine", args, 5.0)).status == "ok"  # resets
        assert server.call(ToolCall(3, 1, "dies", args, 5.0)).status == "crash"
        assert server.healthy
        assert server.call(ToolCall(4, 1, "dies", args, 5.0)).status == "crash"
        assert not server.healthy
        after = server.call(ToolCall(5, 1, "fine", args, 5.0))
        server.submit(ToolCall(6, 1, "fine", args, 5.0))
        (queued,) = server.poll()
    assert (after.status, after.seconds) == ("unavailable", 0.0)  # no child was started
    assert queued.status == "unavailable"
    assert len(lines) == 1 and "node 3" in lines[0] and "\n" not in lines[0]


@pytest.mark.timeout(30)
def test_preflight_passes_here_and_refuses_an_impossible_sandbox():
    registry = build_registry(["calculator"])
    assert preflight(registry, SandboxLimits()) is None
    bad = preflight(registry, SandboxLimits(memory_mb=1))
    assert bad is not None and "tools.enabled=false" in bad and "\n" not in bad


def test_isolation_is_reported():
    iso = detect_isolation()
    print(
        f"network isolation: {iso.network}, PID namespace: {iso.pid_namespace} "
        f"({iso.detail}); python {sys.version.split()[0]}"
    )
    assert iso.detail


# What a tool can open of the process that spawned it (issue 49, finding 11): root reads
# and writes any process's memory and environment through /proc unless it lost its
# capabilities (a user namespace of its own).
PROC_PEEK = r"""
import os, sys
spawner = int(sys.stdin.read())
out = []
for name, flags in (("mem", os.O_RDWR), ("environ", os.O_RDONLY)):
    try:
        os.close(os.open(f"/proc/{spawner}/{name}", flags))
        out.append(name + " opened")
    except OSError as exc:
        out.append(name + " " + type(exc).__name__)
print("; ".join(out))
"""


@pytest.mark.timeout(30)
def test_a_tool_cannot_open_its_spawners_memory():
    iso = detect_isolation()
    if not iso.network:
        pytest.skip(iso.detail)
    assert "--map-root-user" in iso.prefix, iso.detail  # a user namespace, for root too
    me = str(os.getpid()).encode()
    result = run_tool(PROC_PEEK, me, SandboxLimits(), isolation=iso)
    assert (result.status, result.text) == (
        "ok",
        "mem PermissionError; environ PermissionError",
    ), result
    if os.geteuid() == 0:  # without the namespace root could: the test would prove nothing
        bare = run_tool(PROC_PEEK, me, SandboxLimits(), isolation=NO_ISOLATION)
        assert bare.text == "mem opened; environ opened", bare
