"""Hostile telemetry files (security review 2026-12, §6 "Telemetry", attacks 29-34): a run
directory may be someone else's. `report` and `trace` read nothing outside it, allocate
nothing a file cannot hold, write through no planted link and print no terminal escapes;
what they refuse is one line on stderr and exit status 2, in seconds.

Each test starts from a genuine file written by TelemetryWriter and changes one thing.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from pivot_hpc.telemetry import TelemetryWriter
from pivot_hpc.telemetry.errors import printable
from pivot_hpc.telemetry.schema import DTYPES

REPO = Path(__file__).resolve().parents[2]
SECRET = "SECRET-OUTSIDE"
MEMORY_CAP = 1536 << 20  # address space of the CLI under test: far below what a bomb asks
CONFIG = {"cluster": {"nodes": 2, "gpus_per_node": 4}}  # loads; its topology: 8 GPUs


def write_genuine_run(run_dir: Path, **meta: object) -> Path:
    """A small real run (every dataset, a config `trace` can lay out); returns its file."""
    meta = {"mode": "pivot", "strategy": "pivot", "gpus": 8, "config": CONFIG} | meta
    with TelemetryWriter(run_dir, meta=meta) as w:
        w.allocation(0.0, rollout_gpus=6, reward_gpus=2, training_gpus=0, idle_gpus=0,
                     transition_gpus=0)  # fmt: skip
        for t in (0.0, 1.0, 2.0):
            w.throughput(t, role="rollout", replicas=6, gpus=6, n_seq=8, n_queued=0,
                         n_tok=100, tokens_per_s=50.0, est_tokens_per_s=55.0)  # fmt: skip
        w.shift(1.0, kind="up", role="rollout", replica="rollout:0", gpus=1, plan_id=1,
                penalty=1.0, benefit=2.0, discard_s=0.0, read_s=0.1, offload_s=0.0,
                reload_s=0.1, total_s=0.2)  # fmt: skip
        w.migration(1.5, role="rollout", kind="up", sequences=2, abort_s=0.1, dispatch_s=0.1,
                    reprefill_s=0.1)  # fmt: skip
        w.step(0, start=0.0, end=3.0, rollout_tokens=100, reward_tokens=50, train_tokens=100,
               samples=4, reward_mean=0.5, reward_verifiable_mean=0.5, reward_genrm_mean=0.0,
               loss=0.1, staleness_max=0, staleness_mean=0.0, version=1)  # fmt: skip
    return run_dir / "telemetry" / "alloc-001.h5"


def outside_rows(name: str, n: int = 4) -> np.ndarray:
    """Rows of dataset `name` whose text fields all carry SECRET (they are 16+ bytes)."""
    rows = np.zeros(n, dtype=DTYPES[name])
    for field in DTYPES[name].names or ():
        if DTYPES[name][field].kind == "S":
            rows[field] = SECRET.encode()
    return rows


def cli(*argv: object, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m pivot_hpc ARGV` under a memory cap; (result, seconds)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        preexec_fn=cap,
    )
    return r, time.monotonic() - t0


def assert_one_line_refusal(r: subprocess.CompletedProcess, *says: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("pivot-hpc: error: "), err
    for s in says:
        assert s in err, err


# ---------------------------------------------------------------- the genuine file reads


@pytest.mark.slow  # CLI processes (1-2 s)
def test_the_genuine_run_reports_and_traces(tmp_path: Path) -> None:
    write_genuine_run(tmp_path)
    r, _ = cli("report", tmp_path)
    assert r.returncode == 0, r.stderr
    r, _ = cli("trace", tmp_path)
    assert r.returncode == 0, r.stderr
    names = {ev["name"] for ev in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert "shift up: rollout" in names and "rollout tokens/s" in names
    assert (tmp_path / "trace.json").stat().st_mode & 0o077 == 0  # private, like the run dir


# ---------------------------------------------------------------- data from outside the run


def _external_link(path: Path, outside: Path) -> None:
    with h5py.File(outside, "w") as f:
        f.create_dataset("shifts", data=outside_rows("shifts"), maxshape=(None,))
    with h5py.File(path, "r+") as f:
        del f["shifts"]
        f["shifts"] = h5py.ExternalLink(str(outside), "shifts")


def _virtual_dataset(path: Path, outside: Path) -> None:
    with h5py.File(outside, "w") as f:
        f.create_dataset("shifts", data=outside_rows("shifts"))
    layout = h5py.VirtualLayout(shape=(4,), dtype=DTYPES["shifts"])
    layout[:] = h5py.VirtualSource(str(outside), "shifts", shape=(4,))
    with h5py.File(path, "r+") as f:
        del f["shifts"]
        f.create_virtual_dataset("shifts", layout)


def _external_storage(path: Path, outside: Path) -> None:
    rows = outside_rows("migrations")
    outside.write_bytes(b"-----BEGIN PRIVATE KEY-----" + rows.tobytes())
    with h5py.File(path, "r+") as f:
        del f["migrations"]
        f.create_dataset(
            "migrations",
            shape=(len(rows),),
            dtype=DTYPES["migrations"],
            external=[(str(outside), 27, rows.nbytes)],
        )


def _external_link_to_text(path: Path, outside: Path) -> None:
    outside.write_text(f"root:x:0:0:{SECRET}:/root:/bin/sh\n")
    with h5py.File(path, "r+") as f:
        del f["steps"]
        f["steps"] = h5py.ExternalLink(str(outside), "steps")


def _self_link(path: Path, outside: Path) -> None:
    with h5py.File(path, "r+") as f:
        del f["steps"]
        f["steps"] = h5py.ExternalLink(str(path), "steps")


OUTSIDE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "external link to an HDF5 file": (_external_link, "external link"),
    "external link to a text file": (_external_link_to_text, "external link"),
    "external link to itself": (_self_link, "external link"),
    "virtual dataset": (_virtual_dataset, "virtual dataset"),
    "external raw storage": (_external_storage, "external files"),
}


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
@pytest.mark.parametrize("case", sorted(OUTSIDE))
def test_nothing_outside_the_run_is_read(tmp_path: Path, case: str) -> None:
    make, says = OUTSIDE[case]
    run = tmp_path / "run"
    make(write_genuine_run(run), tmp_path / "outside.h5")
    for cmd in ("report", "trace"):
        r, _ = cli(cmd, run)
        assert_one_line_refusal(r, "alloc-001.h5", says)
        assert SECRET not in r.stdout + r.stderr
    assert not (run / "trace.json").exists()


def _leave_open_for_write(path: Path) -> None:
    """Set the file's "open for write" flag as a killed writer leaves it: the reader then
    checks it in a child process first (the SWMR probe), which must refuse the same way."""
    code = "import h5py, os, sys; f = h5py.File(sys.argv[1], 'r+', libver='latest'); "
    code += "f.swmr_mode = True; os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_a_killed_writers_file_is_refused_the_same_way(tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = write_genuine_run(run)
    _external_link(path, tmp_path / "outside.h5")
    _leave_open_for_write(path)
    for cmd in ("report", "trace"):
        r, _ = cli(cmd, run)
        assert_one_line_refusal(r, "alloc-001.h5", "external link")
        assert SECRET not in r.stdout + r.stderr


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_the_probe_imports_nothing_from_the_current_directory(tmp_path: Path) -> None:
    """A module planted in the run directory is not imported by the probe's child even when
    `report` runs from there (`-P`: the parent, too, is run without the cwd on its path)."""
    _leave_open_for_write(write_genuine_run(tmp_path))
    (tmp_path / "h5py.py").write_text("open('PWNED', 'w').close()\n")
    r = subprocess.run(
        [sys.executable, "-P", "-m", "pivot_hpc", "report", "."],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_a_telemetry_file_linked_from_outside_is_refused(tmp_path: Path) -> None:
    genuine = write_genuine_run(tmp_path / "elsewhere")
    run = tmp_path / "run"
    (run / "telemetry").mkdir(parents=True)
    (run / "telemetry" / "alloc-001.h5").symlink_to(genuine)
    r, _ = cli("report", run)
    assert_one_line_refusal(r, "alloc-001.h5", "symbolic link")


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_a_fifo_named_like_telemetry_does_not_hang(tmp_path: Path) -> None:
    (tmp_path / "telemetry").mkdir()
    os.mkfifo(tmp_path / "telemetry" / "alloc-001.h5")
    r, _ = cli("report", tmp_path, timeout=30)
    assert_one_line_refusal(r, "alloc-001.h5", "not a regular file")


# ---------------------------------------------------------------- the wrong kind of object


def _scalar(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        del f["shifts"]
        f.create_dataset("shifts", data=outside_rows("shifts", 1)[0])


def _group(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        del f["shifts"]
        f.create_group("shifts")


def _two_dimensional(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        del f["shifts"]
        f.create_dataset("shifts", data=outside_rows("shifts").reshape(2, 2))


def _variable_length_field(path: Path) -> None:
    dt = np.dtype([(n, h5py.string_dtype() if n == "role" else DTYPES["migrations"][n])
                   for n in DTYPES["migrations"].names or ()])  # fmt: skip
    with h5py.File(path, "r+") as f:
        del f["migrations"]
        f.create_dataset("migrations", shape=(2,), dtype=dt)


def _soft_link(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        del f["shifts"]
        f["shifts"] = h5py.SoftLink("/steps")


def _text_where_a_number_belongs(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs["gpus"] = "eight"


WRONG_KIND: dict[str, tuple[Callable[[Path], None], str]] = {
    "scalar dataset": (_scalar, "has shape (), not one row per entry"),
    "group": (_group, "is a group, not a dataset"),
    "2-D dataset": (_two_dimensional, "has shape (2, 2)"),
    "variable-length field": (_variable_length_field, "variable-length fields"),
    "soft link": (_soft_link, "soft link"),
    "text gpus attribute": (_text_where_a_number_belongs, "'gpus'"),
}


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
@pytest.mark.parametrize("case", sorted(WRONG_KIND))
def test_objects_the_writer_does_not_make_are_one_line(tmp_path: Path, case: str) -> None:
    make, says = WRONG_KIND[case]
    make(write_genuine_run(tmp_path))
    for cmd in ("report", "trace"):
        r, _ = cli(cmd, tmp_path)
        assert_one_line_refusal(r, "alloc-001.h5", says)


# ---------------------------------------------------------------- declared, never written


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
@pytest.mark.parametrize("rows", [30_000_000, 1_000_000_000])
def test_declared_rows_the_file_cannot_hold_are_refused_fast(tmp_path: Path, rows: int) -> None:
    path = write_genuine_run(tmp_path)
    with h5py.File(path, "r+") as f:  # resized, never written: the file stays ~ its size
        del f["throughput"]
        ds = f.create_dataset(
            "throughput", shape=(0,), maxshape=(None,), dtype=DTYPES["throughput"], chunks=(4096,)
        )
        ds.resize((rows,))
    assert path.stat().st_size < 2 << 20
    for cmd in ("report", "trace"):
        r, seconds = cli(cmd, tmp_path)
        assert_one_line_refusal(r, "alloc-001.h5", "'throughput'", f"declares {rows} rows")
        assert seconds < 5, seconds


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_a_saved_config_with_a_huge_cluster_is_refused_fast(tmp_path: Path) -> None:
    write_genuine_run(tmp_path, config={"cluster": {"nodes": 1, "gpus_per_node": 10**7}})
    r, seconds = cli("trace", tmp_path)
    assert_one_line_refusal(r, "saved config", "GPUs")
    assert seconds < 5, seconds


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_a_shift_row_of_a_huge_training_group_is_refused(tmp_path: Path) -> None:
    path = write_genuine_run(tmp_path)
    with h5py.File(path, "r+") as f:
        rows = f["shifts"][...]
        rows["replica"], rows["gpus"] = b"training", 2**31 - 1
        f["shifts"][...] = rows
    r, seconds = cli("trace", tmp_path)
    assert_one_line_refusal(r, "training", "GPUs")
    assert seconds < 5, seconds


# ---------------------------------------------------------------- writing the trace


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_trace_does_not_write_through_a_planted_symlink(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_genuine_run(run)
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    (run / "trace.json").symlink_to(target)
    r, _ = cli("trace", run)
    assert_one_line_refusal(r, "trace.json", "symbolic link")
    assert target.read_text() == "precious"
    assert (run / "trace.json").is_symlink()


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_analysis_figures_do_not_write_through_a_planted_symlink(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_genuine_run(run)
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    (tmp_path / "fig.png").symlink_to(target)
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "analysis" / "timeline.py"),
            run,
            "--out",
            tmp_path / "fig.png",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "symbolic link" in r.stderr and target.read_text() == "precious"


# ---------------------------------------------------------------- terminal escapes

ESCAPES = "\x1b]52;c;c2VjcmV0\x07\x1b[2J\x9b31m\u202e"


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_escapes_in_attributes_and_rows_do_not_reach_the_terminal(tmp_path: Path) -> None:
    path = write_genuine_run(tmp_path, label=f"evil{ESCAPES}label\nforged line")
    with h5py.File(path, "r+") as f:
        rows = f["migrations"][...]
        rows["role"] = b"\x1b[2Jrollout"
        f["migrations"][...] = rows
    r, _ = cli("report", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "evillabel forged line" in r.stdout
    assert all(c not in r.stdout for c in "\x1b\x07\x9b\u202e"), repr(r.stdout)
    r, _ = cli("trace", tmp_path)
    assert r.returncode == 0, r.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    for ev in events:
        assert printable(ev["name"]) == ev["name"], ev
    assert any(ev["name"] == "migrate 2 rollout (up)" for ev in events)


@pytest.mark.slow  # a CLI process per test (0.5-2 s)
def test_escapes_in_error_messages_are_stripped(tmp_path: Path) -> None:
    run = tmp_path / f"run{ESCAPES}\nsecond line"  # a directory name from a tarball
    path = write_genuine_run(run)
    with h5py.File(path, "r+") as f:
        del f["steps"]
        f.create_group("steps")
    r, _ = cli("report", run)
    assert_one_line_refusal(r, "alloc-001.h5", "second line")
    assert all(c not in r.stderr for c in "\x1b\x07\x9b\u202e"), repr(r.stderr)


def test_printable() -> None:
    assert printable("plain text é 漢字") == "plain text é 漢字"
    assert printable(f"a{ESCAPES}b") == "ab"
    assert printable("one\ntwo\r\nthree\u2028four") == "one two three four"
    assert printable("nul\x00del\x7f") == "nuldel"
