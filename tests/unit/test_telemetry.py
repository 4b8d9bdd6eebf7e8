"""HDF5 telemetry: writer → reader round trip, crash safety under SIGKILL, `pivot-hpc report`."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import pivot_hpc
from pivot_hpc.cli.main import main
from pivot_hpc.telemetry import (
    DATASETS,
    FIELDS,
    SCHEMA_VERSION,
    TelemetryError,
    TelemetryWriter,
    last_time,
    open_run,
)
from pivot_hpc.telemetry.schema import DTYPES
from pivot_hpc.telemetry.summary import eq1, role_timeline, summarise, utilisation

REPO = Path(__file__).resolve().parents[2]

# The synthetic trace: 8 GPUs, two allocations. Allocation 1 covers [0, 25] (step 0),
# allocation 2 resumes at 25 (step 1, [25, 45]) with time_offset=25 and local times from 0.
ALLOCATIONS_1 = [  # t, ro, rm, tr, idle, transition
    (0.0, 8, 0, 0, 0, 0),
    (10.0, 4, 2, 0, 0, 2),
    (12.0, 4, 4, 0, 0, 0),
    (20.0, 0, 0, 8, 0, 0),
]
ALLOCATIONS_2 = [(0.0, 6, 2, 0, 0, 0)]  # t=25 after the offset, holds until 45
STEPS = [  # step, start, end, ro_tok, rm_tok, tr_tok, samples, r, r_ver, r_genrm, loss,
    # st_max, st_mean, ver, made_ro, made_rm, skipped_nonfinite
    (0, 0.0, 25.0, 1000, 500, 1000, 8, 0.25, 0.125, 0.125, 0.5, 0, 0.0, 1, 1500.0, 600.0, 0),
    (1, 0.0, 20.0, 2000, 1500, 2000, 8, 0.75, 0.5, 0.25, 0.25, 1, 0.5, 2, 3100.0, 2000.0, 1),  # +25
]
# Hand-computed: (1000 + 500 + 2000 + 1500) tokens / (45 - 0) s.
EXPECTED_TOKENS_PER_S = 5000 / 45
# GPU-seconds over [0, 45]: rollout 80+8+32+120, reward 4+32+40, training 40, transition 4.
EXPECTED_UTIL = {
    "rollout": 240 / 360,
    "reward": 76 / 360,
    "training": 40 / 360,
    "idle": 0.0,
    "transition": 4 / 360,
}
META = {
    "mode": "pivot",
    "strategy": "pivot",
    "gpus": 8,
    "horizon_s": 60.0,
    "simulated": True,
    "config": {"planner": {"horizon_s": 60.0}, "roles": ["rollout", "reward"]},
    "seed": None,
}


def step_fields(row: tuple) -> dict:
    """A STEPS row as the writer's keywords (after the step number; the optional fields
    it lacks are left to the writer)."""
    return dict(zip(DTYPES["steps"].names[1 : len(row)], row[1:], strict=True))


def write_synthetic_run(run_dir: Path, scale: int = 1, **meta_overrides: object) -> Path:
    """Two allocation files of a small, hand-checkable trace (see the constants above);
    `scale` multiplies the steps' rollout and reward tokens (and so the throughput)."""
    meta = META | meta_overrides
    steps = [(*s[:3], s[3] * scale, s[4] * scale, *s[5:]) for s in STEPS]
    with TelemetryWriter(run_dir, meta=meta) as w:
        for t, ro, rm, tr, idle, trans in ALLOCATIONS_1:
            w.allocation(
                t,
                rollout_gpus=ro,
                reward_gpus=rm,
                training_gpus=tr,
                idle_gpus=idle,
                transition_gpus=trans,
            )
        for i, t in enumerate((0.0, 5.0, 10.0, 15.0, 20.0)):
            w.throughput(
                t,
                role="rollout",
                replicas=4,
                gpus=8,
                n_seq=16 - i,
                n_queued=2,
                n_tok=1000 + i,
                tokens_per_s=100.0 + i,
                est_tokens_per_s=110.0 + i,
            )
            w.throughput(
                t,
                role="reward",
                replicas=1,
                gpus=2,
                n_seq=i,
                n_queued=0,
                n_tok=10 * i,
                tokens_per_s=50.0 * (i > 0),
                est_tokens_per_s=55.0,
            )
        w.planner(
            9.0,
            plan_id=1,
            strategy="pivot",
            up_role="reward",
            n_up=2,
            n_down=2,
            candidates=3,
            preprocess_s=0.01,
            construct_s=0.02,
            simulate_s=0.03,
            benefit=120.0,
            throughput_current=80.0,
            throughput_expected=95.0,
        )
        w.planner(
            19.0,
            plan_id=2,
            strategy="pivot",
            up_role="training",
            n_up=1,
            n_down=4,
            candidates=1,
            preprocess_s=0.02,
            construct_s=0.04,
            simulate_s=0.06,
            benefit=30.0,
            throughput_current=60.0,
            throughput_expected=0.0,
        )
        w.shift(
            10.0,
            kind="down",
            role="rollout",
            replica="rollout-2",
            gpus=2,
            plan_id=1,
            penalty=5.0,
            benefit=120.0,
            discard_s=0.1,
            read_s=0.0,
            offload_s=0.2,
            reload_s=0.0,
            total_s=0.3,
        )
        w.shift(
            10.0,
            kind="up",
            role="reward",
            replica="reward-1",
            gpus=2,
            plan_id=1,
            penalty=5.0,
            benefit=120.0,
            discard_s=0.0,
            read_s=0.8,
            offload_s=0.0,
            reload_s=0.1,
            total_s=0.9,
        )
        w.shift(
            20.0,
            kind="up",
            role="training",
            replica="training",
            gpus=8,
            plan_id=2,
            penalty=9.0,
            benefit=30.0,
            discard_s=0.0,
            read_s=1.5,
            offload_s=0.0,
            reload_s=0.5,
            total_s=2.0,
        )
        w.migration(
            10.0,
            role="rollout",
            kind="down",
            sequences=4,
            abort_s=0.01,
            dispatch_s=0.2,
            reprefill_s=0.05,
        )
        w.migration(
            10.5,
            role="reward",
            kind="up",
            sequences=0,
            abort_s=0.0,
            dispatch_s=0.0,
            reprefill_s=0.0,
        )
        w.step(*steps[0][:1], **step_fields(steps[0]))
        w.flush()
    with TelemetryWriter(run_dir, meta=meta, time_offset=25.0) as w:
        for t, ro, rm, tr, idle, trans in ALLOCATIONS_2:
            w.allocation(
                t,
                rollout_gpus=ro,
                reward_gpus=rm,
                training_gpus=tr,
                idle_gpus=idle,
                transition_gpus=trans,
            )
        w.throughput(
            0.0,
            role="rollout",
            replicas=3,
            gpus=6,
            n_seq=12,
            n_queued=0,
            n_tok=800,
            tokens_per_s=90.0,
            est_tokens_per_s=91.0,
        )
        w.throughput(
            0.0,
            role="reward",
            replicas=1,
            gpus=2,
            n_seq=4,
            n_queued=1,
            n_tok=40,
            tokens_per_s=40.0,
            est_tokens_per_s=41.0,
        )
        w.planner(
            5.0,
            plan_id=3,
            strategy="pivot",
            up_role="",
            n_up=0,
            n_down=0,
            candidates=2,
            preprocess_s=0.03,
            construct_s=0.06,
            simulate_s=0.09,
            benefit=-1.0,
            throughput_current=70.0,
            throughput_expected=70.0,
        )
        w.shift(
            6.0,
            kind="up",
            role="rollout",
            replica="rollout-3",
            gpus=2,
            plan_id=3,
            penalty=1.0,
            benefit=10.0,
            discard_s=0.0,
            read_s=0.5,
            offload_s=0.0,
            reload_s=0.0,
            total_s=0.5,
        )
        w.step(*steps[1][:1], **step_fields(steps[1]))
    return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_synthetic_run(tmp_path / "run")


def test_one_file_per_allocation_with_every_dataset(run_dir: Path) -> None:
    files = sorted((run_dir / "telemetry").glob("alloc-*.h5"))
    assert [f.name for f in files] == ["alloc-001.h5", "alloc-002.h5"]
    for f in files:  # closed cleanly: plain h5py opens it, every dataset is there
        with h5py.File(f, "r") as h:
            assert set(DATASETS) <= set(h)
            assert h["shifts"].dtype["role"] == np.dtype("S16")
            assert h["shifts"].dtype["replica"] == np.dtype("S48")
            assert h["throughput"].maxshape == (None,) and h["throughput"].chunks is not None
            assert h.attrs["mode"] == "pivot" and h.attrs["gpus"] == 8
            assert h.attrs["seed"] == ""  # None -> ""
            assert json.loads(h.attrs["config"])["planner"]["horizon_s"] == 60.0
            assert h.attrs["schema_version"] == SCHEMA_VERSION and h.attrs["hostname"]


def test_round_trip_every_dataset_and_field(run_dir: Path) -> None:
    run = open_run(run_dir)
    assert [p.name for p in run.files] == ["alloc-001.h5", "alloc-002.h5"]
    assert run.mode == "pivot" and run.attr("gpus") == 8 and run.attr("simulated") is True
    assert run.meta["config"] == META["config"]  # JSON attributes come back decoded
    assert [m["alloc_index"] for m in run.file_meta] == [1, 2]
    assert [m["time_offset_s"] for m in run.meta["files"]] == [0.0, 25.0]
    for name in DATASETS:
        assert run[name].dtype.names == tuple(f for f, *_ in FIELDS[name])

    alloc = run["allocation"]
    expected = [*ALLOCATIONS_1, *((t + 25.0, *rest) for t, *rest in ALLOCATIONS_2)]
    assert [tuple(r) for r in alloc.tolist()] == expected
    assert run.row_file["allocation"].tolist() == [0, 0, 0, 0, 1]

    steps = run["steps"]
    assert steps["step"].tolist() == [0, 1]
    assert steps["start"].tolist() == [0.0, 25.0] and steps["end"].tolist() == [25.0, 45.0]
    got = [tuple(r)[3:] for r in steps.tolist()]
    assert got == [s[3:] for s in STEPS]

    tp = run["throughput"]
    assert len(tp) == 12 and set(tp["role"]) == {"rollout", "reward"}
    ro = run.role("rollout")
    assert ro["t"].tolist() == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
    assert ro["n_seq"].tolist() == [16, 15, 14, 13, 12, 12]
    assert ro[1].tolist() == (5.0, "rollout", 4, 8, 15, 2, 1001, 101.0, 111.0, 0)

    sh = run["shifts"]
    assert sh["kind"].tolist() == ["down", "up", "up", "up"]
    assert sh["replica"].tolist() == ["rollout-2", "reward-1", "training", "rollout-3"]
    assert sh["t"].tolist() == [10.0, 10.0, 20.0, 31.0]
    assert sh[0].tolist() == (
        10.0,
        "down",
        "rollout",
        "rollout-2",
        2,
        1,
        5.0,
        120.0,
        0.1,
        0.0,
        0.2,
        0.0,
        0.3,
    )

    pl = run["planner"]
    assert pl["plan_id"].tolist() == [1, 2, 3] and pl["t"].tolist() == [9.0, 19.0, 30.0]
    assert pl["up_role"].tolist() == ["reward", "training", ""]
    assert pl[0].tolist() == (
        9.0,
        1,
        "pivot",
        "reward",
        2,
        2,
        3,
        0.01,
        0.02,
        0.03,
        120.0,
        80.0,
        95.0,
    )

    mig = run["migrations"]
    assert mig.tolist() == [
        (10.0, "rollout", "down", 4, 0.01, 0.2, 0.05),
        (10.5, "reward", "up", 0, 0.0, 0.0, 0.0),
    ]
    assert run.end_time == 45.0 and last_time(run_dir) == 45.0


def test_summary_matches_hand_computation(run_dir: Path) -> None:
    s = summarise(open_run(run_dir))
    assert s["steps"] == 2 and s["tokens"] == 5000 and s["duration_s"] == 45.0
    assert s["steps_skipped_nonfinite"] == 1  # step 1's gradient was not finite
    assert s["tokens_per_s"] == pytest.approx(EXPECTED_TOKENS_PER_S)
    assert s["utilisation"] == pytest.approx(EXPECTED_UTIL)
    assert s["gpu_seconds"] == pytest.approx(360.0)
    assert s["shifts"] == 3 and s["shifts_down"] == 1 and s["shift_plans"] == 3
    assert s["shifts_per_step"] == pytest.approx(1.5)
    assert s["planner_calls"] == 3
    assert s["planner_total_median_s"] == pytest.approx(0.12)  # totals 0.06, 0.12, 0.18
    assert s["planner_total_p90_s"] == pytest.approx(0.168)
    assert s["migration_per_seq"]["total"]["mean"] == pytest.approx(0.26)  # empty event skipped
    assert s["reward_mean_first"] == 0.25 and s["reward_mean_last"] == 0.75


def test_redone_step_counts_once(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path)
    with TelemetryWriter(tmp_path, meta=META, time_offset=45.0) as w:  # step 1 again
        w.step(
            1,
            start=0.0,
            end=15.0,
            rollout_tokens=2000,
            reward_tokens=1500,
            train_tokens=2000,
            samples=8,
            reward_mean=0.5,
            reward_verifiable_mean=0.25,
            reward_genrm_mean=0.25,
            loss=0.25,
            staleness_max=1,
            staleness_mean=0.5,
            version=2,
        )
    s = summarise(open_run(tmp_path))
    assert s["steps"] == 2 and s["reward_mean_last"] == 0.5
    assert s["tokens_per_s"] == pytest.approx(5000 / 60)


def test_eq1_and_timeline() -> None:
    # 10 seqs at 100 tok/s + 30 seqs at 50 tok/s: 40 / (0.1 + 0.6)
    got = eq1([10, 0, 5, 0], [100, 0, 0, 5], [30, 7, 5, 0], [50, 70, 10, 0])
    assert got.tolist() == pytest.approx([40 / 0.7, 70.0, 0.0, 0.0])


def test_timeline_forward_fills(run_dir: Path) -> None:
    tl = role_timeline(open_run(run_dir))
    assert tl["t"].tolist() == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
    assert tl["reward"].tolist() == [0.0, 50.0, 50.0, 50.0, 50.0, 40.0]
    assert tl["overall"][0] == pytest.approx(100.0)  # reward has no work yet
    n_ro, n_rm = 15, 1
    assert tl["overall"][1] == pytest.approx((n_ro + n_rm) / (n_ro / 101.0 + n_rm / 50.0))


def test_utilisation_last_row_holds_to_end() -> None:
    alloc = np.array([(0.0, 2, 2, 0, 0, 0)], dtype=open_dtype("allocation"))
    assert utilisation(alloc, 10.0)["rollout"] == 0.5
    assert utilisation(alloc[:0], 10.0)["gpu_seconds"] == 0.0


def open_dtype(name: str) -> np.dtype:
    from pivot_hpc.telemetry.schema import DTYPES

    return DTYPES[name]


def test_writer_meta_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    with TelemetryWriter(tmp_path, meta={"mode": "colocated", "n": np.int64(3)}) as w:
        path = w.path
    with h5py.File(path, "r") as h:
        assert h.attrs["slurm_job_id"] == "4242" and h.attrs["slurm_restart_count"] == "1"
        assert "slurm_array_job_id" not in h.attrs
        assert h.attrs["n"] == 3 and h.attrs["pivot_hpc_version"]
        assert all(len(h[name]) == 0 for name in DATASETS)  # empty datasets exist up front
    with pytest.raises(TypeError, match="meta\\['bad'\\]"):
        TelemetryWriter(tmp_path, meta={"bad": object()})
    with pytest.raises(ValueError, match="schema_version"):
        TelemetryWriter(tmp_path, meta={"schema_version": 9})
    with pytest.raises(ValueError, match="pivot_hpc_version"):
        TelemetryWriter(tmp_path, meta={"pivot_hpc_version": "0.0.0-other"})
    assert sorted(p.name for p in (tmp_path / "telemetry").iterdir()) == ["alloc-001.h5"]
    # The writer's own version may be repeated in meta; a config given as JSON text is
    # decoded by Run.config.
    meta = {"pivot_hpc_version": pivot_hpc.__version__, "config": '{"planner": {"h": 1}}'}
    TelemetryWriter(tmp_path, meta=meta).close()
    run = open_run(tmp_path)
    assert run.file_meta[1]["alloc_index"] == 2 and run.file_meta[1]["config"].startswith("{")
    assert open_run(run.files[1]).config == {"planner": {"h": 1}}


def test_writer_rejects_bad_rows_and_use_after_close(tmp_path: Path) -> None:
    w = TelemetryWriter(tmp_path, meta={})
    with pytest.raises(ValueError, match="'sideways'"):
        w.shift(
            0.0,
            kind="sideways",
            role="rollout",
            replica="r",
            gpus=1,
            plan_id=0,
            penalty=0.0,
            benefit=0.0,
            discard_s=0.0,
            read_s=0.0,
            offload_s=0.0,
            reload_s=0.0,
            total_s=0.0,
        )
    w.shift(
        0.0,
        kind="up",
        role="rollout",
        replica="r" * 49,
        gpus=1,
        plan_id=0,
        penalty=0.0,
        benefit=0.0,
        discard_s=0.0,
        read_s=0.0,
        offload_s=0.0,
        reload_s=0.0,
        total_s=0.0,
    )
    with pytest.raises(ValueError, match="shifts.replica .* at most 48"):
        w.flush()
    w._buf["shifts"].clear()
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.flush()


def test_reader_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TelemetryError, match="does not exist"):
        open_run(tmp_path / "nope")
    with pytest.raises(TelemetryError, match="no telemetry files"):
        open_run(tmp_path)
    assert last_time(tmp_path) == 0.0
    write_synthetic_run(tmp_path)
    bad = tmp_path / "telemetry" / "alloc-003.h5"
    bad.write_bytes(b"not hdf5 at all")
    with pytest.raises(TelemetryError, match="alloc-003.h5: cannot open"):
        open_run(tmp_path)


def test_many_rows_across_flushes(tmp_path: Path) -> None:
    # (speed is a benchmark concern: ~0.2 s here for 100k rows; tests check behaviour)
    n = 100_000
    with TelemetryWriter(tmp_path, meta={}) as w:
        for i in range(n):
            w.throughput(
                float(i),
                role="rollout",
                replicas=1,
                gpus=1,
                n_seq=i,
                n_queued=0,
                n_tok=i,
                tokens_per_s=1.0,
                est_tokens_per_s=1.0,
            )
            if i % 20_000 == 0:
                w.flush()
    rows = open_run(tmp_path)["throughput"]
    assert len(rows) == n and (rows["n_seq"] == np.arange(n)).all()


CRASH_WRITER = textwrap.dedent(
    """
    import sys, time
    from pivot_hpc.telemetry import TelemetryWriter
    w = TelemetryWriter(sys.argv[1], meta={"mode": "pivot"})
    i = 0
    while True:
        for _ in range(10):
            w.throughput(float(i), role="rollout", replicas=1, gpus=1, n_seq=i, n_queued=0,
                         n_tok=i, tokens_per_s=1.0, est_tokens_per_s=1.0)
            i += 1
        w.allocation(float(i), rollout_gpus=1, reward_gpus=0, training_gpus=0, idle_gpus=0,
                     transition_gpus=0)
        w.flush()
        print(i, flush=True)  # rows 0..i-1 are on disk now
        time.sleep(0.005)
    """
)


def test_sigkill_keeps_every_flushed_row(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    flushed = 0
    try:
        deadline = time.monotonic() + 30
        while flushed < 200 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "writer exited early"
            flushed = int(line)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert flushed >= 200
    run = open_run(tmp_path)  # opens the killed writer's file
    tp = run["throughput"]
    assert len(tp) >= flushed  # flushes after the last line we read may have landed too
    assert tp["n_seq"][:flushed].tolist() == list(range(flushed))
    assert tp["n_seq"].tolist() == list(range(len(tp)))  # whole flushes only, in order
    assert len(run["allocation"]) == len(tp) // 10
    with h5py.File(run.files[0], "r", swmr=True) as h:
        assert h["throughput"].shape[0] == len(tp)


def test_read_while_the_writer_is_running(tmp_path: Path) -> None:
    """`pivot-hpc report` on a live run: another process reads what was flushed so far."""
    read = "from pivot_hpc.telemetry import open_run; import sys; "
    read += "print(len(open_run(sys.argv[1])['steps']))"
    with TelemetryWriter(tmp_path, meta={}) as w:
        for i in range(3):
            w.step(
                i,
                start=i,
                end=i + 1.0,
                rollout_tokens=1,
                reward_tokens=1,
                train_tokens=1,
                samples=1,
                reward_mean=0.0,
                reward_verifiable_mean=0.0,
                reward_genrm_mean=0.0,
                loss=0.0,
                staleness_max=0,
                staleness_mean=0.0,
                version=i,
            )
        w.flush()
        w.step(
            3,
            start=3.0,
            end=4.0,
            rollout_tokens=1,
            reward_tokens=1,
            train_tokens=1,
            samples=1,
            reward_mean=0.0,
            reward_verifiable_mean=0.0,
            reward_genrm_mean=0.0,
            loss=0.0,
            staleness_max=0,
            staleness_mean=0.0,
            version=3,
        )  # buffered only
        out = subprocess.run(
            [sys.executable, "-c", read, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_report_cli_json(run_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "report", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {
        "mode",
        "steps",
        "tokens_per_s",
        "shifts",
        "reward_mean_first",
        "reward_mean_last",
    } <= set(data)
    assert data["mode"] == "pivot" and data["steps"] == 2 and data["shifts"] == 3
    assert data["tokens_per_s"] == pytest.approx(EXPECTED_TOKENS_PER_S)
    assert data["reward_mean_first"] == 0.25 and data["reward_mean_last"] == 0.75
    assert not any(isinstance(v, float) and math.isnan(v) for v in data.values())


def test_report_cli_text_and_errors(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "111.1 tokens/s" in text and "rollout 66.7%" in text
    assert main(["report", str(run_dir / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err


def test_readme_documents_every_field() -> None:
    readme = (REPO / "analysis" / "README.md").read_text()
    for name, fields in FIELDS.items():
        assert f"`{name}`" in readme, name
        for field, *_ in fields:
            assert f"`{field}`" in readme, f"{name}.{field}"


def test_schema_1_files_read_the_newer_datasets_as_empty(tmp_path: Path) -> None:
    """A run directory written before `trained`/`checkpoints` existed still opens."""
    with TelemetryWriter(tmp_path, meta={"mode": "pivot"}) as w:
        w.step(
            0,
            start=0.0,
            end=1.0,
            rollout_tokens=10,
            reward_tokens=5,
            train_tokens=20,
            samples=4,
            reward_mean=0.5,
            reward_verifiable_mean=0.5,
            reward_genrm_mean=0.0,
            loss=0.1,
            staleness_max=0,
            staleness_mean=0.0,
            version=1,
        )
    path = tmp_path / "telemetry" / "alloc-001.h5"
    with h5py.File(path, "r+") as f:  # rewrite it as a schema-1 file
        del f["trained"], f["checkpoints"], f["evals"]
        f.attrs["schema_version"] = 1
    r = open_run(tmp_path)
    assert len(r["steps"]) == 1
    assert len(r["trained"]) == 0 and len(r["checkpoints"]) == 0
    assert r["trained"].dtype.names == _field_names("trained")


def test_schema_2_steps_read_the_made_tokens_as_nan(run_dir: Path) -> None:
    """Steps rows written before `made_*_tokens` existed read them as NaN (not counted);
    a writer that leaves them out (a live run) writes NaN too."""
    path = run_dir / "telemetry" / "alloc-001.h5"
    with h5py.File(path, "r+") as f:  # rewrite its steps as schema 2 wrote them
        old = f["steps"][...]
        keep = [n for n in old.dtype.names if not n.startswith("made_")]
        del f["steps"]
        f.create_dataset("steps", data=old[keep], maxshape=(None,))
        f.attrs["schema_version"] = 2
    steps = open_run(run_dir)["steps"]
    assert steps.dtype.names == _field_names("steps")
    assert np.isnan(steps["made_rollout_tokens"][0]) and np.isnan(steps["made_reward_tokens"][0])
    assert steps["made_rollout_tokens"][1] == 3100.0  # the other file is schema 3
    assert steps["reward_mean"].tolist() == [0.25, 0.75]
    with TelemetryWriter(run_dir / "live", meta=META) as w:
        w.step(*STEPS[0][:1], **step_fields(STEPS[0][:14]))
    live = open_run(run_dir / "live")["steps"]
    assert np.isnan(live["made_rollout_tokens"]).all() and live["loss"].tolist() == [0.5]


def _field_names(name: str) -> tuple[str, ...]:
    return tuple(f for f, *_ in FIELDS[name])


def _killed_writer_file(tmp_path: Path) -> bytes:
    """The bytes of a telemetry file whose writer was killed mid-run (SWMR flag still set)."""
    src = tmp_path / "src"
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_WRITER, str(src)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        while int(proc.stdout.readline() or 0) < 300:
            pass
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return next((src / "telemetry").glob("alloc-*.h5")).read_bytes()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torn_and_bit_flipped_telemetry_reads_or_fails_in_seconds(tmp_path: Path) -> None:
    """Every cut point class (inside the superblock, metadata, data, the tail) and bit flips
    across the file: `report` and the resume path (`last_time`) finish in seconds with the
    data or one clear error naming the file, never a hang or a traceback."""
    data = _killed_writer_file(tmp_path)
    n = len(data)
    rng = np.random.default_rng(0)
    cases = [("cut", c) for c in (1, 8, 20, 47, 48, 200, 1024, 4096, n // 3, n // 2, n - 1)]
    cases += [("flip", int(i)) for i in rng.integers(0, n, 12)]
    run = tmp_path / "case"
    for kind, at in cases:
        b = bytearray(data[:at] if kind == "cut" else data)
        if kind == "flip":
            b[at] ^= 0x10
        (run / "telemetry").mkdir(parents=True, exist_ok=True)
        (run / "telemetry" / "alloc-001.h5").write_bytes(bytes(b))
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "pivot_hpc", "report", str(run), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert time.monotonic() - t0 < 30, (kind, at)
        assert "Traceback" not in r.stderr, (kind, at, r.stderr[-500:])
        if r.returncode:
            assert r.returncode == 2 and "alloc-001.h5" in r.stderr, (kind, at, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1, (kind, at, r.stderr)
            with pytest.raises(TelemetryError, match="alloc-001.h5"):
                last_time(run)


def _foreign_attrs(**attrs):
    def make(path: Path) -> None:
        with h5py.File(path, "w") as f:
            for k, v in attrs.items():
                f.attrs[k] = v

    return make


FOREIGN = {
    "not hdf5": (lambda p: p.write_text("garbage"), "not an HDF5 file"),
    "a directory": (lambda p: p.mkdir(), "unreadable"),
    "an empty hdf5": (_foreign_attrs(), "not a pivot_hpc telemetry file"),
    "text version": (_foreign_attrs(schema_version="two"), "not a pivot_hpc telemetry file"),
    "future version": (_foreign_attrs(schema_version=99), "upgrade pivot_hpc"),
    "bad json attrs": (
        _foreign_attrs(schema_version=2, json_keys='["x"'),
        "damaged file attributes",
    ),
    "missing datasets": (_foreign_attrs(schema_version=2), "is missing"),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_files_that_are_not_our_telemetry_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    make, says = FOREIGN[case]
    (tmp_path / "telemetry").mkdir()
    make(tmp_path / "telemetry" / "alloc-001.h5")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "alloc-001.h5" in err and says in err
