"""engines/base.py is the whole contract (docs/design.md §5): the worker's seats call
nothing on an engine or a trainer that its protocol does not declare, they never probe an
engine (getattr, hasattr, isinstance) or name an engine class, every proxy of a protocol
(an engine in a child process, the guard over it, a trainer with its step groups) has all
of it, and the engines are built by one factory. (That the real engines have every member
is checked where they can be built: tests/engines/test_engine_conformance.py,
tests/engines/test_megatron_engine.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pivot_hpc.engines.base import (
    InferenceEngine,
    SupervisedEngine,
    SupervisedTrainer,
    TrainEngine,
    Trainer,
    protocol_members,
)

RUNTIME = Path(__file__).resolve().parents[2] / "pivot_hpc" / "runtime"
ENGINE_CLASSES = (
    "ChildEngine",
    "ChildTrainer",
    "GuardedEngine",
    "LocalTrainer",
    "HFEngine",
    "VLLMEngine",
    "SGLangEngine",
    "MegatronTrainEngine",
    "EngineProcessError",
)


def _is_self_attr(node: ast.AST, name: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _uses(source: str, holder) -> set[str]:
    """Every `X.attr` where `holder(X)` says X is an engine or a trainer."""
    return {
        node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and holder(node.value)
    }


def _trainer(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "trainer") or _is_self_attr(node, "trainer")


def _engine(node: ast.AST) -> bool:
    """`engine`, `self.serving`, `self.engines[...]`, `self.engines.pop(...)`."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    if isinstance(node, ast.Subscript):
        return _is_self_attr(node.value, "engines")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("pop", "get") and _is_self_attr(node.func.value, "engines")
    return _is_self_attr(node, "serving")


CASES = [
    ("training_seat.py", _trainer, SupervisedTrainer),
    ("training_world.py", _trainer, Trainer),  # publish/read the optimizer: any trainer
    ("inference_seat.py", _engine, SupervisedEngine),
]


@pytest.mark.parametrize("module, holder, protocol", CASES, ids=[c[0] for c in CASES])
def test_the_seats_call_only_what_the_protocols_declare(module, holder, protocol) -> None:
    used = _uses((RUNTIME / module).read_text(), holder)
    assert used, f"{module} no longer uses an engine: update this test"
    undeclared = used - set(protocol_members(protocol))
    assert not undeclared, f"{module} calls {sorted(undeclared)} outside {protocol.__name__}"


def test_the_runtime_never_probes_an_engine_or_names_its_class() -> None:
    for path in sorted(RUNTIME.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                named = {a.name for a in node.names} & set(ENGINE_CLASSES)
                assert not named, f"{path.name} imports {sorted(named)}"
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "isinstance")
                and node.args
                and (_engine(node.args[0]) or _trainer(node.args[0]))
            ):
                pytest.fail(f"{path.name}:{node.lineno} probes an engine with {node.func.id}")


def _proxies():
    from pivot_hpc.engines.process.child import ChildEngine, ChildTrainer
    from pivot_hpc.engines.process.guard import GuardedEngine
    from pivot_hpc.engines.process.local import LocalTrainer

    return [
        (ChildEngine, InferenceEngine),
        (GuardedEngine, SupervisedEngine),
        (ChildTrainer, SupervisedTrainer),
        (LocalTrainer, SupervisedTrainer),
    ]


@pytest.mark.parametrize("proxy, protocol", _proxies(), ids=lambda x: x.__name__)
def test_every_proxy_has_its_whole_protocol(proxy, protocol) -> None:
    missing = [
        name
        for name in protocol_members(protocol)
        if not hasattr(proxy, name) and name not in proxy.__annotations__
    ]
    assert not missing, f"{proxy.__name__} lacks {missing}"


def test_a_trainer_in_the_rank_forwards_to_its_engine_and_forms_its_step_groups() -> None:
    from pivot_hpc.engines.process.local import LocalTrainer

    calls = []

    class Engine:
        version, steps, dp, dp_rank, device = 3, 2, 1, 0, "cpu"

        def train_step(self, batch, loss="grpo"):
            calls.append(("train_step", batch, loss))
            return {"loss": 1.0}

        def use_data_parallel(self, group, size, rank):
            calls.append(("use_data_parallel", group, size, rank))

    class Groups:
        def form(self, members, rank):
            calls.append(("form", members, rank))

        def of(self, members):
            return ("group", 2, 1)

    t = LocalTrainer(Engine(), Groups(), rank=5)
    assert not t.dead
    assert t.version == 3 and t.train_step("b", loss="sft") == {"loss": 1.0}
    t.form_groups((5, 6))
    t.use_members((5, 6))
    assert calls == [
        ("train_step", "b", "sft"),
        ("form", (5, 6), 5),
        ("use_data_parallel", "group", 2, 1),
    ]


def test_the_factory_honours_rl_trainer_engine() -> None:
    from types import SimpleNamespace

    from pivot_hpc.engines.factory import make_train_engine

    cfg = SimpleNamespace(rl=SimpleNamespace(trainer=SimpleNamespace(engine="fsdp")))
    with pytest.raises(ValueError, match="rl.trainer.engine='fsdp'"):
        make_train_engine(cfg, None)  # type: ignore[arg-type]
    seat = (RUNTIME / "training_seat.py").read_text()
    assert "make_trainer" in seat and "make_train_engine" not in seat
    assert set(protocol_members(TrainEngine)) - set(protocol_members(SupervisedTrainer)) == {
        "use_data_parallel"
    }
