"""The `tools` section of the run config, what launchers refuse before launch, and the
sandbox service a node's host rank starts before MPI (runtime/host_tools.py), without MPI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.cli.main import main
from pivot_hpc.config import to_dict
from pivot_hpc.errors import ConfigError, PivotError
from pivot_hpc.job.config import ClusterConfig, Config, default_dict, load_config
from pivot_hpc.runtime import host_tools
from pivot_hpc.runtime.protocol import Command, Event, Stop
from pivot_hpc.runtime.world import LayoutError, check_before_launch, check_tools

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
CALC = '{"expression": "47+38+96"}'


# ------------------------------------------------------------------ the config section
def test_the_tools_section_is_off_by_default_and_round_trips(tmp_path: Path) -> None:
    assert default_dict()["tools"]["enabled"] is False
    cfg = load_config(TINY, ["tools.enabled=true", "tools.max_turns=3", "tools.memory_mb=128"])
    assert (cfg.tools.enabled, cfg.tools.max_turns, cfg.tools.tools) == (True, 3, ("calculator",))
    path = tmp_path / "again.yaml"
    path.write_text(json.dumps(to_dict(cfg)))  # JSON is YAML
    assert to_dict(load_config(str(path), [])) == to_dict(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tools.shell=true", "unknown key .tools.shell."),
        ("tools.tools=[calculator,shell]", "unknown tool"),
        ("tools.max_tool_output_tokens=4096", "below tools.max_context_tokens"),
        ("tools.truncation_side=middle", "valid choices"),
    ],
)
def test_tools_mistakes_are_refused_in_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_config(TINY, [override])
    assert "\n" not in str(info.value)


def test_config_show_lists_the_tools_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", TINY, "tools.enabled=true"]) == 0
    out = capsys.readouterr().out
    assert "\ntools: " in out and "docs/guide/agentic.md" in out
    assert "enabled: true" in out and "[default: false]" in out


def test_protocol_carries_the_agentic_messages_as_they_are() -> None:
    from pivot_hpc.agentic import messages

    assert ToolCall is messages.ToolCall and ToolResult is messages.ToolResult
    assert ToolCall in Command.__args__ and ToolResult in Event.__args__


# ------------------------------------------------------------------ before launch
def _enabled(**tools: object) -> Config:
    return load_config(TINY, ["tools.enabled=true", *(f"tools.{k}={v}" for k, v in tools.items())])


def test_disabled_tools_are_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import pivot_hpc.agentic.server as server

    monkeypatch.setattr(server, "preflight", lambda *a: pytest.fail("preflight ran"))
    check_tools(load_config(TINY, []))


@pytest.mark.timeout(60)
def test_enabled_tools_pass_the_checks_where_the_sandbox_runs() -> None:
    check_before_launch(_enabled())  # the turn loop exists: only the preflight is left


@pytest.mark.timeout(60)
def test_a_missing_runtime_part_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import pivot_hpc.runtime.world as world

    monkeypatch.setattr(world, "TOOLS_MISSING", "the widget")
    with pytest.raises(LayoutError) as info:
        check_before_launch(_enabled())
    line = str(info.value)
    assert "\n" not in line
    assert "the widget" in line and "docs/guide/agentic.md" in line
    assert "tools.enabled=false" in line


def test_a_sandbox_that_cannot_run_is_refused_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pivot_hpc.agentic.server as server

    why = "tools are enabled but the sandbox cannot run tool 'calculator' on this machine (crash)"
    monkeypatch.setattr(server, "preflight", lambda registry, limits: why)
    with pytest.raises(LayoutError, match=r"cannot run tool 'calculator'") as info:
        check_tools(_enabled())
    assert str(info.value) == why


@pytest.mark.timeout(60)
def test_run_refuses_what_the_runtime_lacks_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pivot_hpc.runtime.world as world

    monkeypatch.setattr(world, "TOOLS_MISSING", "the widget")
    run_dir = tmp_path / "run"
    assert main(["run", TINY, "--run-dir", str(run_dir), "tools.enabled=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the widget" in err[0], err
    assert not run_dir.exists()  # refused before anything was written


# ------------------------------------------------------------------ the service, no MPI
def _cfg(enabled: bool = True) -> Config:
    return Config(
        cluster=ClusterConfig(nodes=2, gpus_per_node=1), tools=ToolsConfig(enabled=enabled)
    )


@pytest.fixture(autouse=True)
def _no_service(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(host_tools, "_service", None)


def _no_spawn(*args: object, **kwargs: object) -> None:
    pytest.fail("a process was started")


def test_no_service_when_disabled_or_not_a_host_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "Popen", _no_spawn)
    assert host_tools.start_before_mpi(_cfg(False), {"OMPI_COMM_WORLD_RANK": "0"}) is None
    assert host_tools.start_before_mpi(_cfg(False), {}) is None  # not even the rank is needed
    # ranks_per_node = 2: ranks 1 and 3 are workers
    for rank in ("1", "3"):
        assert host_tools.start_before_mpi(_cfg(), {"SLURM_PROCID": rank}) is None
    assert host_tools.local_service() is None


def test_a_rank_that_cannot_tell_its_place_is_refused_in_one_line() -> None:
    with pytest.raises(PivotError, match="OMPI_COMM_WORLD_RANK") as info:
        host_tools.start_before_mpi(_cfg(), {})
    assert "\n" not in str(info.value)


def test_the_launchers_rank_variables() -> None:
    assert host_tools.world_rank_before_mpi({"PMIX_RANK": "6", "SLURM_PROCID": "2"}) == 6
    assert host_tools.world_rank_before_mpi({"SLURM_PROCID": "2"}) == 2
    assert host_tools.world_rank_before_mpi({"PMI_RANK": "x"}) is None


def _wait_results(service: host_tools.HostToolService, n: int) -> dict[int, ToolResult]:
    got: dict[int, ToolResult] = {}
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got.update((r.call_id, r) for r in service.poll())
        time.sleep(0.005)
    return got


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.timeout(60)
def test_a_host_rank_runs_calls_in_its_service_and_ends_it() -> None:
    service = host_tools.start_before_mpi(_cfg(), {"OMPI_COMM_WORLD_RANK": "2"})
    assert service is not None and service.node == 1
    assert host_tools.start_before_mpi(_cfg(), {"OMPI_COMM_WORLD_RANK": "2"}) is service
    assert service.wait_ready()  # the isolation it found, in words
    service.submit(ToolCall(1, 9, "calculator", CALC, 5.0))
    service.submit(ToolCall(2, 9, "calculator", '{"expression": "x"}', 5.0))
    got = _wait_results(service, 2)
    assert (got[1].status, got[1].text) == ("ok", "181")
    assert got[2].status == "error"
    assert service.outstanding == 0
    pid = service.pid
    service.close()
    assert _gone(pid)
    service.close()  # idempotent


@pytest.mark.timeout(60)
def test_the_service_ends_when_its_rank_dies() -> None:
    # the rank's end of the socket closes with the rank (here: closed without close())
    service = host_tools.HostToolService.start(ToolsConfig(enabled=True), node=0)
    service.wait_ready()
    service._sock.close()
    assert service._proc.wait(timeout=30) == 0


@pytest.mark.timeout(60)
def test_a_dead_service_answers_every_call_unavailable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    service = host_tools.HostToolService.start(ToolsConfig(enabled=True), node=3)
    service.wait_ready()
    os.kill(service.pid, signal.SIGKILL)
    service._proc.wait(timeout=30)
    service.submit(ToolCall(1, 9, "calculator", CALC, 5.0))
    service.submit(ToolCall(2, 9, "calculator", CALC, 5.0))
    got = _wait_results(service, 2)
    assert sorted(got) == [1, 2] and {r.status for r in got.values()} == {"unavailable"}, got
    assert not service.alive
    warnings = [line for line in capsys.readouterr().err.splitlines() if "node 3" in line]
    assert len(warnings) == 1 and "sandbox service stopped" in warnings[0], warnings
    service.close()


@pytest.mark.timeout(60)
def test_a_service_that_cannot_start_says_why() -> None:
    bad = ToolsConfig(enabled=True, tools=("nonexistent",))  # refused in the service
    service = host_tools.HostToolService.start(bad, node=0)
    with pytest.raises(host_tools.ToolServiceError, match="unknown tool"):
        service.wait_ready()
    service.close()


# ------------------------------------------------------------------ the host rank's loop
class _FakeComm:
    """The coordinator's side of CMD/EVT for `serve_host`, in one process."""

    def __init__(self, commands: list[object]) -> None:
        self.commands = list(commands)
        self.sent: list[object] = []

    def Get_rank(self) -> int:
        return 2

    def Iprobe(self, source: int, tag: int) -> bool:
        return bool(self.commands)

    def recv(self, source: int, tag: int) -> object:
        return self.commands.pop(0)

    def send(self, obj: object, dest: int, tag: int) -> None:
        self.sent.append(obj)


def test_without_tools_a_host_rank_answers_calls_unavailable_and_stops() -> None:
    comm = _FakeComm([ToolCall(5, 1, "calculator", CALC, 5.0), Stop(3)])
    assert host_tools.serve_host(comm, _cfg(False)) == 3
    assert [(r.call_id, r.status) for r in comm.sent] == [(5, "unavailable")]


def test_a_host_rank_refuses_a_command_it_does_not_serve() -> None:
    from pivot_hpc.runtime.protocol import ShiftDown

    with pytest.raises(host_tools.ToolServiceError, match="ShiftDown"):
        host_tools.serve_host(_FakeComm([ShiftDown()]), _cfg(False))


def test_tools_enabled_without_a_service_fails_clearly() -> None:
    with pytest.raises(host_tools.ToolServiceError, match="before MPI"):
        host_tools.serve_host(_FakeComm([Stop(0)]), _cfg())


@pytest.mark.timeout(60)
def test_a_host_rank_serves_calls_through_its_service() -> None:
    service = host_tools.start_before_mpi(_cfg(), {"OMPI_COMM_WORLD_RANK": "0"})
    assert service is not None

    class Comm(_FakeComm):
        def Iprobe(self, source: int, tag: int) -> bool:
            # Stop only once the call is answered (the coordinator's contract)
            return bool(self.commands) and (len(self.commands) > 1 or bool(self.sent))

    comm = Comm([ToolCall(8, 1, "calculator", CALC, 5.0), Stop(0)])
    assert host_tools.serve_host(comm, _cfg()) == 0
    assert [(r.call_id, r.status, r.text) for r in comm.sent] == [(8, "ok", "181")]
    assert _gone(service.pid)  # Stop ended it
