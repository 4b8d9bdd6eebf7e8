"""TrainEngine is the whole contract (docs/design.md §5): the runtime calls nothing on a
training engine that engines/base.py's protocol does not declare, and the engine is built
from `rl.trainer.engine` by one factory. (That MegatronTrainEngine has every member is
checked where it can be built: tests/engines/test_megatron_engine.py.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from pivot_hpc.engines.base import TrainEngine

RUNTIME = Path(__file__).resolve().parents[2] / "pivot_hpc" / "runtime"


def _members(proto: type) -> set[str]:
    names = {n for n in vars(proto) if not n.startswith("_")}
    return names | set(inspect.get_annotations(proto))


def _trainer_attributes(source: str) -> set[str]:
    """Every `X.attr` where X is `trainer` or `self.trainer`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "trainer") or (
            isinstance(base, ast.Attribute)
            and base.attr == "trainer"
            and isinstance(base.value, ast.Name)
            and base.value.id == "self"
        ):
            found.add(node.attr)
    return found


@pytest.mark.parametrize("module", ["worker.py", "elastic.py"])
def test_the_runtime_calls_only_what_the_protocol_declares(module: str) -> None:
    used = _trainer_attributes((RUNTIME / module).read_text())
    assert used, f"{module} no longer uses a trainer: update this test"
    undeclared = used - _members(TrainEngine)
    assert not undeclared, f"{module} calls {sorted(undeclared)} outside TrainEngine"


def test_the_factory_honours_rl_trainer_engine() -> None:
    from types import SimpleNamespace

    from pivot_hpc.engines.train_factory import make_train_engine

    cfg = SimpleNamespace(rl=SimpleNamespace(trainer=SimpleNamespace(engine="fsdp")))
    with pytest.raises(ValueError, match="rl.trainer.engine='fsdp'"):
        make_train_engine(cfg, None)  # type: ignore[arg-type]
    worker = (RUNTIME / "worker.py").read_text()
    assert "make_train_engine" in worker and "MegatronTrainEngine" not in worker
