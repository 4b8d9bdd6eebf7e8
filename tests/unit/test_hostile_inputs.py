"""Inputs from someone else (issue 33): each one gets one clear line, fast, in bounded memory.

Every hostile file is built here in tmp_path; the reproducers are those of the security
review (YAML bombs and deep nesting, absurd cluster sizes, Parquet and JSONL bombs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivot_hpc.config import loader as config_loader
from pivot_hpc.config.loader import MAX_SHOWN_CHARS, ConfigError, load_yaml_text, short_repr
from pivot_hpc.errors import PivotError
from pivot_hpc.job.config import load_config

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def billion_laughs() -> str:
    """9 levels of 9 aliases as `loop.steps` (the review's 370-byte bomb): 9**9 values once
    expanded, which the "expected an integer, got ..." message used to print in full."""
    lines = [f"  - &a [{','.join(['lol'] * 9)}]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"  - &{name} [{','.join([f'*{prev}'] * 9)}]")
    return "loop:\n  steps:\n" + "\n".join(lines) + "\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def one_line(exc: BaseException, *words: str) -> str:
    msg = str(exc)
    assert "\n" not in msg and len(msg) < 2000, msg
    for w in words:
        assert w in msg, msg
    return msg


# ------------------------------------------------------------------------------ YAML
def test_billion_laughs_config_is_refused_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "bomb.yaml", billion_laughs())
    assert len(path.read_bytes()) < 400
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert time.monotonic() - start < 1.0
    one_line(info.value, "bomb.yaml", "aliases", "not supported", "line 3")


@pytest.mark.slow  # a CLI process
def test_billion_laughs_through_config_show_is_exit_2_and_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "bomb.yaml", billion_laughs())
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "config", "show", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and "bomb.yaml" in err[0] and "aliases" in err[0], out.stderr
    assert time.monotonic() - start < 20  # interpreter start-up included


@pytest.mark.parametrize(
    "value",
    ["&a [1, *a]", "[&x lol, *x, *x]", "{<<: {a: 1}, b: *a}", "*undefined"],
)
def test_aliases_in_an_override_are_refused(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"loop.steps={value}"])
    one_line(info.value, "override", "aliases")


def test_merge_key_anchor_in_a_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "merge.yaml", "base: &b {steps: 1}\nloop:\n  <<: *b\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    one_line(info.value, "merge.yaml", "aliases")


@pytest.mark.slow  # 1-1.5 s
def test_deep_nesting_is_one_line(tmp_path: Path) -> None:
    deep = "[" * 5000 + "]" * 5000
    path = write(tmp_path, "deep.yaml", f"loop:\n  steps: {deep}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    one_line(info.value, "deep.yaml", "nested")
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"loop.steps={deep}"])
    one_line(info.value, "override", "nested")


def test_recursion_error_itself_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the depth cap the composer recurses until Python stops it."""
    monkeypatch.setattr(config_loader, "MAX_YAML_DEPTH", 10**6)
    with pytest.raises(ConfigError) as info:
        load_yaml_text("a: " + "[" * 5000 + "]" * 5000, "config file 'deep.yaml'")
    one_line(info.value, "deep.yaml", "nested too deeply")


def test_5000_digit_integer_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "int.yaml", "loop:\n  steps: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    one_line(info.value, "int.yaml", "integer", "too long")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["loop.steps=" + "9" * 5000])
    one_line(info.value, "override", "integer")


def test_value_error_from_a_constructor_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's int-str limit raised inside PyYAML (the review's traceback)."""
    monkeypatch.setattr(config_loader, "MAX_YAML_INT_CHARS", 10**6)
    with pytest.raises(ConfigError) as info:
        load_yaml_text("a: " + "9" * 5000, "config file 'int.yaml'")
    one_line(info.value, "int.yaml", "cannot be read")


def test_oversized_yaml_file_is_refused_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_loader, "MAX_YAML_CHARS", 1000)
    path = write(tmp_path, "big.yaml", "loop:\n  steps: 1\n" + "# pad\n" * 500)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    one_line(info.value, "big.yaml", "larger than 1000 bytes")


def test_the_shared_yaml_readers_refuse_aliases(tmp_path: Path) -> None:
    from pivot_hpc.sim.catalog import CatalogError, read_profile

    path = write(tmp_path, "profile.yaml", "throughput: &t {A: 1}\nagain: *t\n")
    with pytest.raises(CatalogError) as info:
        read_profile(path)
    one_line(info.value, "profile.yaml", "aliases")
    pytest.importorskip("torch")
    from pivot_hpc.engines.profile import load_profile

    with pytest.raises(ConfigError) as info:
        load_profile(path)
    one_line(info.value, "profile.yaml", "aliases")


def test_genuine_yaml_still_loads() -> None:
    text = "a: {b: [1, 2.5, 'x', null, true]}\nc: 0x1f\nd: 1e-6\n"
    assert load_yaml_text(text, "t") == {
        "a": {"b": [1, 2.5, "x", None, True]},
        "c": 31,
        "d": "1e-6",
    }
    assert load_config(TINY).cluster.world_size == 5


# ------------------------------------------------------------- long values in messages
@pytest.mark.slow  # 1.5 s of YAML
def test_long_values_are_cut_in_error_messages(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["loop.steps=" + "x" * 100_000])
    msg = one_line(info.value, "loop.steps", "...")
    assert "x" * (MAX_SHOWN_CHARS + 1) not in msg
    path = write(tmp_path, "long.yaml", "loop:\n  steps: [" + ", ".join(["7"] * 50_000) + "]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    one_line(info.value, "loop.steps")
    keys = "\n".join(f"  k{i}{'y' * 500}: 1" for i in range(50))
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "keys.yaml", f"loop:\n{keys}\n"))
    one_line(info.value, "unknown config key", "and 45 more")
    with pytest.raises(ConfigError) as info:
        load_config(None, ["z" * 10_000])
    one_line(info.value, "override")


def test_short_repr_is_bounded() -> None:
    assert len(short_repr("a" * 10**6)) <= MAX_SHOWN_CHARS
    assert len(short_repr(list(range(10**5)))) <= MAX_SHOWN_CHARS
    assert len(short_repr({str(i): "v" * 1000 for i in range(100)})) <= MAX_SHOWN_CHARS
    assert "too large" in short_repr(10**5000)  # repr() itself would raise ValueError
    assert short_repr("\x1b[2J") == repr("\x1b[2J")  # escapes stay escaped


# ------------------------------------------------------------------------ world size
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cluster.gpus_per_node=10000000", "cluster.gpus_per_node"),
        ("cluster.nodes=100000000", "cluster.nodes"),
    ],
)
def test_absurd_cluster_sizes_fail_validation(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    one_line(info.value, key, "at most")


def test_the_simulators_thousands_of_gpus_still_validate() -> None:
    from pivot_hpc.config import validate_tree
    from pivot_hpc.job.simulate import scale_to

    root = Path(__file__).parents[2] / "configs" / "groups"
    for path in sorted(root.glob("*.yaml")):
        validate_tree(scale_to(load_config(path, files=False), 4096))


def test_local_world_is_bounded_by_this_machines_cores() -> None:
    from pivot_hpc.cli.local_world import check_world_fits

    check_world_fits(load_config(TINY), env={}, cpus=2)  # 5 ranks on 2 cores: the tests
    big = load_config(TINY, ["cluster.gpus_per_node=64"])
    with pytest.raises(ConfigError) as info:
        check_world_fits(big, env={}, cpus=2)
    one_line(info.value, "cluster.gpus_per_node=64", "65 ranks", "bound is 64")
    check_world_fits(big, env={}, cpus=16)  # 8 per core: 128


def test_slurm_world_is_bounded_by_the_allocation() -> None:
    from pivot_hpc.cli.local_world import check_world_fits

    cfg = load_config(TINY, ["cluster.nodes=4"])
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS": "20"}
    check_world_fits(cfg, env=job, cpus=2)  # per node, not in all, against the cores
    with pytest.raises(ConfigError) as info:
        check_world_fits(cfg, env={**job, "SLURM_JOB_NUM_NODES": "2"}, cpus=2)
    one_line(info.value, "cluster.nodes", "2 node(s)")
    with pytest.raises(ConfigError) as info:
        check_world_fits(cfg, env={**job, "SLURM_NTASKS": "8"}, cpus=2)
    one_line(info.value, "SLURM_NTASKS=8", "20 ranks")
    check_world_fits(cfg, env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4(x5)"}, cpus=2)


def test_pivot_hpc_run_refuses_a_huge_world_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pivot_hpc.cli import local_world
    from pivot_hpc.cli.main import main

    def no_launch(*_args: object, **_kw: object) -> int:
        raise AssertionError("launch reached")

    monkeypatch.setattr(local_world, "launch", no_launch)
    monkeypatch.setattr(local_world.os, "cpu_count", lambda: 2)
    for name in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun either
    run_dir = tmp_path / "r"
    argv = ["run", TINY, "--run-dir", str(run_dir), "cluster.nodes=2", "cluster.gpus_per_node=40"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster.gpus_per_node=40" in err[0] and "82 ranks" in err[0]
    assert main(["run", TINY, "--run-dir", str(run_dir), "cluster.gpus_per_node=10000000"]) == 2
    assert "at most 64" in capsys.readouterr().err


# ---------------------------------------------------------------------------- datasets
@pytest.mark.slow  # 1-2 s
def test_parquet_bomb_is_refused_fast_in_bounded_memory(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n = 2_000_000
    zeros = pa.array([0] * n, pa.int32())
    table = pa.table(
        {
            "problem": pa.DictionaryArray.from_arrays(zeros, pa.array(["x" * 2000])),
            "answer": pa.DictionaryArray.from_arrays(zeros, pa.array(["7"])),
        }
    )
    path = tmp_path / "bomb.parquet"
    pq.write_table(table, path)
    assert path.stat().st_size < 1_000_000  # 4 GB of text once expanded
    code = (
        "import resource, sys, time\n"
        "from pivot_hpc.data.loaders import usable_problems\n"
        "from pivot_hpc.errors import PivotError\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    usable_problems(sys.argv[1], 'rl.data.train')\n"
        "except PivotError as e:\n"
        "    print(e)\n"
        "print(time.monotonic() - t)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    msg, seconds, max_rss_kb = out.stdout.strip().splitlines()
    assert "bomb.parquet" in msg and "cap of 2147483648 characters" in msg, msg
    assert float(seconds) < 15
    # KB. The review saw 4.5 GB and a MemoryError. Alone this measures ~90 MB; once, inside
    # the full suite on a loaded machine, 1.4 GB (not reproduced alone): the bound is the
    # point, not the allocator's retention
    assert int(max_rss_kb) < 2_500_000


def parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_caps_per_field_and_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pivot_hpc.data import loaders

    path = parquet(
        tmp_path / "d.parquet",
        [{"prompt": [{"role": "user", "content": "q" * 500}], "answer": "1"}] * 3,
    )
    assert loaders.load_problems(path)[1].kept == 3
    monkeypatch.setattr(loaders, "MAX_FIELD_CHARS", 100)
    with pytest.raises(PivotError) as info:
        loaders.usable_problems(path, "rl.data.train")
    one_line(info.value, "d.parquet", "500 characters", "'prompt'", "cap of 100")
    monkeypatch.setattr(loaders, "MAX_FIELD_CHARS", 1000)
    monkeypatch.setattr(loaders, "MAX_ROWS", 2)
    with pytest.raises(PivotError) as info:
        loaders.usable_problems(path, "rl.data.train")
    one_line(info.value, "d.parquet", "3 rows", "cap of 2")


def test_genuine_dictionary_encoded_parquet_still_loads(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from pivot_hpc.data.loaders import load_problems

    idx = pa.array([0, 1, 0, 1], pa.int32())
    table = pa.table(
        {
            "problem": pa.DictionaryArray.from_arrays(idx, pa.array(["2+2?", "3+3?"])),
            "answer": pa.DictionaryArray.from_arrays(idx, pa.array(["4", "6"])),
            "unused": pa.array([[1.0] * 3] * 4),
        }
    )
    pq.write_table(table, tmp_path / "ok.parquet")
    found, report = load_problems(tmp_path / "ok.parquet")
    assert [(p.prompt, p.answer, p.uid) for p in found] == [
        ("2+2?", "4", "0"),
        ("3+3?", "6", "1"),
        ("2+2?", "4", "2"),
        ("3+3?", "6", "3"),
    ]
    assert report.kept == 4


def test_deep_and_huge_jsonl_rows_are_counted_not_tracebacks(tmp_path: Path) -> None:
    from pivot_hpc.data.loaders import load_problems, usable_problems

    good = json.dumps({"problem": "1+1?", "answer": "2"})
    deep = "[" * 100_000 + "]" * 100_000
    big_int = '{"problem": "p", "answer": ' + "9" * 5000 + "}"
    path = write(tmp_path, "d.jsonl", f"{deep}\n{big_int}\n{good}\n")
    found, report = load_problems(path)
    assert [p.answer for p in found] == ["2"]
    assert report.malformed == {"nested too deeply": 1, "invalid JSON": 1}
    only_deep = write(tmp_path, "deep.jsonl", deep + "\n")
    with pytest.raises(PivotError) as info:
        usable_problems(only_deep, "rl.data.train")
    one_line(info.value, "deep.jsonl", "nested too deeply")


def test_jsonl_caps_per_line_and_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pivot_hpc.data import loaders

    row = json.dumps({"problem": "q" * 300, "answer": "2"})
    path = write(tmp_path, "d.jsonl", f"{row}\n" * 4)
    monkeypatch.setattr(loaders, "MAX_LINE_CHARS", 100)
    with pytest.raises(PivotError) as info:
        loaders.usable_problems(path, "rl.data.train")
    one_line(info.value, "d.jsonl", "line 1", "100 characters")
    monkeypatch.setattr(loaders, "MAX_LINE_CHARS", 1000)
    monkeypatch.setattr(loaders, "MAX_TOTAL_CHARS", 1000)
    with pytest.raises(PivotError) as info:
        loaders.usable_problems(path, "rl.data.train")
    one_line(info.value, "d.jsonl", "cap of 1000 characters")
    monkeypatch.setattr(loaders, "MAX_TOTAL_CHARS", 10**6)
    monkeypatch.setattr(loaders, "MAX_ROWS", 3)
    with pytest.raises(PivotError) as info:
        loaders.usable_problems(path, "rl.data.train")
    one_line(info.value, "d.jsonl", "more than 3 rows")


def test_out_of_memory_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pivot_hpc.data import loaders

    def oom(*_args: object, **_kw: object) -> None:
        raise MemoryError

    monkeypatch.setattr(loaders, "load_problems", oom)
    with pytest.raises(PivotError) as info:
        loaders.usable_problems(tmp_path / "x.jsonl", "rl.data.train")
    one_line(info.value, "rl.data.train", "out of memory")
