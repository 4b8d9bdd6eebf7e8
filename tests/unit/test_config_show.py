"""`pivot-hpc config show`: the resolved config as YAML a run accepts, every key documented;
the README's config examples load as they are written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.config import load_config, to_dict

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def test_show_prints_yaml_that_loads_back_to_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", TINY, "rl.trainer.lr=1e-6"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"lr: 1\.0e-06 +# Adam learning rate \[default: 0\.0001\]", out)
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert to_dict(load_config(str(shown), [])) == to_dict(
        load_config(TINY, ["rl.trainer.lr=1e-6"])
    )


def test_every_key_has_its_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", TINY, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) > 150
    assert [r["key"] for r in rows if not r["doc"].strip()] == []


def test_show_refuses_a_bad_override_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", TINY, "rl.trainer.lrr=1"]) == 2
    assert "rl.trainer.lrr" in capsys.readouterr().err


def test_readme_config_examples_load(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    for block in blocks:
        path = tmp_path / "example.yaml"
        path.write_text(block)
        load_config(str(path), [])
