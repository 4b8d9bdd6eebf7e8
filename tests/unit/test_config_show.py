"""`pivot-hpc config show`: the resolved config as YAML a run accepts, every key documented;
the config examples of the README and the user guide (docs/guide/) load as they are written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.config import to_dict
from pivot_hpc.job.config import load_config

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


def _yaml_blocks(path: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize(
    "doc",
    [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_doc_config_examples_load(doc: Path, tmp_path: Path) -> None:
    blocks = _yaml_blocks(doc)
    if doc.name == "README.md":
        assert len(blocks) >= 2
    for block in blocks:
        path = tmp_path / "example.yaml"
        path.write_text(block)
        load_config(str(path), [])


def test_the_guide_has_config_examples() -> None:
    assert sum(len(_yaml_blocks(p)) for p in (REPO / "docs" / "guide").glob("*.md")) >= 3
