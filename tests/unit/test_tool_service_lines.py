"""Issue 49, findings 7 and 11 (the service's part): a node's sandbox service outlives a
call line over its 4 MiB limit (a parked call in a crafted checkpoint is reissued as it was
saved): that call is refused, the next ones are served. The service, which spawns every
tool call, is not dumpable."""

from __future__ import annotations

import socket
import time

import pytest

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.agentic.service import MAX_LINE_BYTES, LineReader, encode
from pivot_hpc.runtime.host_tools import HostToolService

BIG = '{"expression":"' + "1" * (5 << 20) + '"}'  # 5 MiB of arguments


def ask(svc: HostToolService, call: ToolCall | None, call_id: int) -> ToolResult:
    if call is not None:
        svc.submit(call)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for r in svc.poll():
            if r.call_id == call_id:
                return r
        time.sleep(0.02)
    raise AssertionError(f"no answer to call {call_id}")


@pytest.fixture
def service():
    svc = HostToolService.start(ToolsConfig(enabled=True), node=0)
    try:
        svc.wait_ready(60)
        yield svc
    finally:
        svc.close()


@pytest.mark.timeout(120)
def test_an_overlong_call_is_refused_and_the_service_serves_on(service) -> None:
    ok = ToolCall(1, 1, "calculator", '{"expression": "1+1"}', 5.0)
    first = ask(service, ok, 1)
    assert (first.status, first.text) == ("ok", "2"), first
    big = ask(service, ToolCall(2, 2, "calculator", BIG, 5.0), 2)
    assert big.status == "error" and "longer than" in big.text, big
    # the same line sent as it is, past the rank's own bound (what a rank of another
    # version, or a bug, would send): the service refuses it by its call id, and lives
    service._pending.add(3)
    service._sock.setblocking(True)
    service._sock.sendall(encode(ToolCall(3, 3, "calculator", BIG, 5.0)))
    service._sock.setblocking(False)
    raw = ask(service, None, 3)
    assert raw.status == "error" and "longer than" in raw.text, raw
    after = ask(service, ToolCall(4, 4, "calculator", '{"expression": "2+2"}', 5.0), 4)
    assert (after.status, after.text) == ("ok", "4") and service.alive
    assert service._proc.poll() is None


@pytest.mark.timeout(60)
def test_the_service_is_not_dumpable(service) -> None:
    assert service.dumpable is False


def test_line_reader_skips_an_overlong_line_whole() -> None:
    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        reader = LineReader(b)
        head = b'{"call_id":77,"x":"'
        payload = head + b"y" * (MAX_LINE_BYTES + 10) + b'"}\nnext\n'
        a.setblocking(False)
        got, sent = [], 0
        while sent < len(payload):
            try:
                sent += a.send(payload[sent : sent + 65536])
            except BlockingIOError:
                pass
            got += reader.read()
        got += reader.read()
        assert got == [b"next"]
        (kept,) = reader.take_overlong()
        assert kept.startswith(head) and len(kept) <= LineReader.HEAD_BYTES
    finally:
        a.close()
        b.close()
