"""`pivot-hpc plan`: the memory plan against known figures, every shipped config, and the
pre-launch refusal of `pivot-hpc run` / `submit`.

Assumed byte counts (pivot_hpc/planning/memory.py): bf16 weights 2 B/param, fp32 main
grads 4 B/param (megatron DDP with grad_reduce_in_fp32=True, as the engine builds it),
AdamW m + v 8 B/param and fp32 masters 4 B/param: 18 B/param per GPU with bf16 parameters
(Megatron's table; 6 + 12/dp with the distributed optimizer), 16 B/param in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.cli.plan import load_for_plan, make_plan, plan_json
from pivot_hpc.config import ConfigError
from pivot_hpc.errors import PivotError
from pivot_hpc.gps import ModelSpec as GPSModelSpec
from pivot_hpc.gps.layout import max_node_bytes
from pivot_hpc.job.config import TINY_DEFAULTS, load_config
from pivot_hpc.planning import MemoryPlanError, build_plan, check_memory
from pivot_hpc.planning.host import gps_bytes
from pivot_hpc.planning.inputs import GIB, TrainInputs, catalog_key, live_inputs, sim_inputs
from pivot_hpc.planning.memory import (
    engine_context,
    optimizer_bytes,
    training_activations,
    training_memory,
)
from pivot_hpc.sim.catalog import MODELS

ROOT = Path(__file__).resolve().parents[2]
GROUPS = sorted((ROOT / "configs" / "groups").glob("group*.yaml"))
SHIPPED = sorted((ROOT / "configs").rglob("*.yaml"))
ROLE_KEYS = {
    "weights_gib",
    "grads_gib",
    "optimizer_gib",
    "activations_gib",
    "kv_gib",
    "total_gib",
    "capacity_gib",
    "fits",
}


def _train(model: str = "qwen2.5-7b", **kw) -> TrainInputs:
    base = dict(
        model=MODELS[model],
        tp=1,
        gpus=8,
        dtype="bf16",
        micro_batch=1,
        seq_len=8192,
        attention="sdpa",
        recompute="none",
        distributed_optimizer=False,
    )
    return TrainInputs(**{**base, **kw})


# ------------------------------------------------------------------ known figures
@pytest.mark.parametrize(
    ("name", "published"),
    [("qwen2.5-1.5b", 1.54e9), ("qwen2.5-7b", 7.61e9), ("qwen2.5-32b", 32.8e9),
     ("qwen2.5-72b", 72.7e9), ("glm-z1-9b", 9.4e9), ("qwen3-30b-a3b", 30.5e9)],
)  # fmt: skip
def test_parameter_counts_match_the_published_ones(name: str, published: float) -> None:
    assert MODELS[name].params == pytest.approx(published, rel=0.02)


@pytest.mark.parametrize(("dtype", "per_param"), [("bf16", 18), ("fp32", 16)])
def test_weights_grads_and_adam_bytes_per_parameter(dtype: str, per_param: int) -> None:
    t = _train(dtype=dtype)
    r = training_memory(t, None)
    static = r.weights + r.grads + r.optimizer
    assert static / t.model.params == pytest.approx(per_param)
    assert r.grads / t.model.params == 4  # fp32 main grads
    assert r.optimizer / t.model.params == (12 if dtype == "bf16" else 8)


def test_review_figures_qwen7b_plain_optimizer_and_local_attention_scores() -> None:
    # docs/research: 18 B/param x 7.6e9 ≈ 137 GB on one TP1 GPU
    r = training_memory(_train(), None)
    assert (r.weights + r.grads + r.optimizer) / 1e9 == pytest.approx(137, rel=0.01)
    # Qwen2.5-1.5B, local spec, 8192 tokens: 6 B x 12 heads x s^2 x 28 layers ≈ 135 GB kept
    t = _train("qwen2.5-1.5b", attention="local")
    local, _ = training_activations(t)
    sdpa, _ = training_activations(dataclasses.replace(t, attention="sdpa"))
    assert (local - sdpa) / 1e9 == pytest.approx(135, rel=0.05)


def test_distributed_optimizer_divides_optimizer_state_by_dp() -> None:
    for gpus, tp in ((8, 1), (64, 8), (32, 4)):
        t = _train("qwen2.5-32b", gpus=gpus, tp=tp)
        plain = optimizer_bytes(t)
        dist = optimizer_bytes(dataclasses.replace(t, distributed_optimizer=True))
        assert dist == pytest.approx(plain / (gpus // tp))
        r = training_memory(dataclasses.replace(t, distributed_optimizer=True), None)
        # Megatron's 6 + 12/dp B/param (of this rank's tp shard)
        assert (r.weights + r.grads + r.optimizer) / (t.model.params / tp) == pytest.approx(
            6 + 12 / (gpus // tp)
        )


@pytest.mark.parametrize("attention", ["local", "sdpa"])
def test_recompute_reduces_activations(attention: str) -> None:
    t = _train("qwen2.5-1.5b", attention=attention, seq_len=17408)
    none, selective, full = (sum(training_activations(t, m)) for m in ("none", "selective", "full"))
    assert none >= selective > full
    if attention == "local":
        assert none > 3 * selective  # the stored scores dominate
    r_none = training_memory(t, None)
    r_full = training_memory(dataclasses.replace(t, recompute="full"), None)
    assert r_full.total < r_none.total


def test_activations_scale_with_micro_batch_and_tensor_parallelism() -> None:
    one = sum(training_activations(_train(micro_batch=1)))
    four = sum(training_activations(_train(micro_batch=4)))
    assert four == pytest.approx(4 * one)
    tp1 = training_activations(_train("qwen2.5-32b"))[0]
    tp4 = training_activations(_train("qwen2.5-32b", tp=4))[0]
    assert tp1 / 4 < tp4 < tp1  # the norm-region tensors are whole on every rank


def test_gps_bytes_agree_with_the_gps_layout() -> None:
    # the plan's per-node GPS bytes = pivot_hpc/gps/layout.py's for the same dense models
    hf = {
        "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    gps = {"policy": GPSModelSpec.from_hf_config(hf, "policy")}
    gps["genrm"] = GPSModelSpec.from_hf_config(hf, "genrm")
    spec = MODELS["qwen2.5-1.5b"]
    assert gps["policy"].num_params == pytest.approx(spec.params, rel=0.01)
    p = dataclasses.replace(
        live_inputs(load_config(None, ["cluster.nodes=4"])),
        gps_models=(("policy", spec.params, 2, True), ("genrm", spec.params, 2, False)),
    )
    for k in (1, 2, 4):
        layout = max_node_bytes(gps, {"policy"}, k)
        assert gps_bytes(p) / k == pytest.approx(layout, rel=0.01)


# a config naming a model directory sets what the tiny job's defaults size (job/config.py)
SIZED = [f"{key}=4096" for key in TINY_DEFAULTS]


def test_model_directories_outside_the_catalog_are_described(arch_dirs, tmp_path) -> None:
    # config.json and the safetensors headers (models/description.py): nested text config,
    # MoE, hybrid attention layers
    cfg = load_config(
        None,
        [
            f"models.policy_path={arch_dirs['qwen2-tied']}",
            f"models.genrm_path={arch_dirs['qwen3.5-moe-vl']}",
            *SIZED,
        ],
    )
    p = live_inputs(cfg)
    policy, genrm = p.rollout.model, p.reward.model
    assert (policy.hidden, policy.heads, policy.kv_heads, policy.tied) == (128, 8, 4, True)
    assert (genrm.experts, genrm.experts_active, genrm.expert_ffn, genrm.ffn) == (4, 2, 32, 0)
    assert genrm.kv_attention_layers == 1  # one full-attention layer, one linear
    broken = tmp_path / "Broken-Model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    bad = load_config(None, [f"models.genrm_path={broken}", *SIZED])
    with pytest.raises(PivotError) as info:
        live_inputs(bad)
    msg = str(info.value)
    assert "models.genrm_path" in msg and "no hidden_size" in msg and "\n" not in msg


def test_catalog_names_from_model_directories() -> None:
    assert catalog_key("Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert catalog_key("Qwen2.5-72B") == "qwen2.5-72b"
    assert catalog_key("GLM-Z1-9B-0414") == "glm-z1-9b"
    assert catalog_key("Llama-3-8B") is None


# --------------------------------------------------------------- shipped configs
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_config_has_a_plan_with_the_json_keys(path: Path) -> None:
    t0 = time.perf_counter()
    cfg, data = load_for_plan(str(path), [])
    out = plan_json(make_plan(cfg, data), str(path))
    assert time.perf_counter() - t0 < 1.0
    for name in ("rollout", "reward", "training"):
        assert ROLE_KEYS <= set(out["roles"][name]), name
        assert out["roles"][name]["total_gib"] > 0
    if out["roles"]["shift"] is not None:
        assert ROLE_KEYS <= set(out["roles"]["shift"])
    node = out["node"]
    assert {"gps_replicated_gib", "gps_gib", "group_size", "pinned_gib", "reads"} <= set(node)
    json.dumps(out)


@pytest.mark.parametrize("source", ["live", "sim"])
@pytest.mark.parametrize("path", GROUPS, ids=lambda p: p.stem)
def test_the_paper_groups_fit_96_gb_h20s_as_shipped(path: Path, source: str) -> None:
    cfg, data = load_for_plan(str(path), [])
    plan = make_plan(cfg, data, source)
    assert plan.inputs.gpu == "h20" and plan.inputs.capacity_gib == pytest.approx(95.5, abs=0.1)
    assert plan.fits is True, plan.failures()
    for name, r in plan.roles.items():
        assert r is not None and r.fits, name
        assert r.total < r.capacity
    if source == "live":  # the knobs that make them fit
        t = plan.inputs.training
        assert (t.attention, t.recompute, t.distributed_optimizer) == ("sdpa", "full", True)


@pytest.mark.parametrize("path", GROUPS, ids=lambda p: p.stem)
def test_today_s_engine_defaults_do_not_fit_and_the_plan_names_the_fix(path: Path) -> None:
    overrides = [
        "rl.trainer.attention=local",
        "rl.trainer.recompute=none",
        "rl.trainer.distributed_optimizer=false",
    ]
    cfg, data = load_for_plan(str(path), overrides)
    plan = make_plan(cfg, data)
    assert "training" in plan.failures()
    fix = plan.fixes["training"]
    assert fix is not None and fix.total < plan.inputs.capacity_gib * GIB
    assert all(o.startswith("rl.trainer.") for o in fix.overrides)


def test_sim_and_live_twins_agree_on_the_policy() -> None:
    cfg, _ = load_for_plan(str(GROUPS[1]), [])  # one config, read both ways
    live, sim = live_inputs(cfg), sim_inputs(cfg)
    assert live.training.model == sim.training.model == MODELS["qwen2.5-7b"]
    assert live.reward.model == sim.reward.model == MODELS["qwen3-30b-a3b"]


def test_inference_kv_pool_follows_mem_fraction_static() -> None:
    cfg, data = load_for_plan(
        str(GROUPS[1]),
        ["rollout.kv_capacity_tokens=10000000", "engines.rollout.mem_fraction_static=0.85"],
    )
    r = make_plan(cfg, data).roles["rollout"]
    assert r.fits and r.kv_tokens < 10_000_000  # SGLang's pool: the static share, not the ask
    assert r.static_budget == pytest.approx(0.85 * r.capacity)
    e = make_plan(cfg, data).inputs.rollout
    assert r.weights + r.kv + engine_context(e) == pytest.approx(r.static_budget)
    cfg, data = load_for_plan(str(GROUPS[3]), ["reward.tp=2"])
    plan = make_plan(cfg, data)
    assert plan.roles["reward"].problem == "pool"
    assert plan.fixes["reward"].overrides == ("reward.tp=4",)


def test_gps_groups_of_k_nodes_under_a_budget() -> None:
    cfg, data = load_for_plan(str(GROUPS[0]), ["gps.host_budget_gib=12"])
    node = make_plan(cfg, data).node
    assert node.group_size == 2 and node.gps == pytest.approx(node.gps_replicated / 2)
    assert node.fits is True
    cfg, data = load_for_plan(str(GROUPS[0]), ["gps.host_budget_gib=1"])
    plan = make_plan(cfg, data)
    assert plan.node.fits is False and "node" in plan.failures()


# ------------------------------------------------------------------ config keys
def test_new_config_keys_are_validated() -> None:
    cfg = load_config(None, [])
    t = cfg.rl.trainer
    assert (t.attention, t.recompute, t.distributed_optimizer) == ("local", "none", False)
    assert cfg.cluster.gpu is None and cfg.cluster.gpu_memory_gib == 0
    for bad, key in (
        ("rl.trainer.attention=flash", "rl.trainer.attention"),
        ("rl.trainer.recompute=all", "rl.trainer.recompute"),
        ("rl.trainer.distributed_optimizer=3", "rl.trainer.distributed_optimizer"),
        ("cluster.gpu=a100", "cluster.gpu"),
        ("cluster.gpu_memory_gib=-1", "cluster.gpu_memory_gib"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])


def test_gpu_memory_gib_sets_the_capacity() -> None:
    check_memory(load_config(ROOT / "configs" / "tiny.yaml"))  # no GPU named: not checked
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["cluster.gpu_memory_gib=0.5"])
    with pytest.raises(MemoryPlanError, match=r"^memory plan: \w+ needs .* GPU has 0\.5 GiB"):
        check_memory(cfg)
    plan = build_plan(live_inputs(load_config(None, ["cluster.gpu_memory_gib=24"])))
    assert plan.inputs.capacity_gib == 24 and plan.fits is True


# -------------------------------------------------------------- pre-launch refusal
@pytest.fixture
def planted(tmp_path: Path) -> list[str]:
    """Overrides that make configs/groups/group1 load here: model directories named after
    the catalog models (tiny stand-ins of their architectures: the launch checks each for
    its roles), and dataset files."""
    from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir

    out = []
    for key, name, arch in (
        ("policy", "Qwen2.5-1.5B", "qwen2-tied"),
        ("genrm", "GLM-Z1-9B", "glm4"),
    ):
        d = build_arch_dir(arch, tmp_path / name)
        out.append(f"models.{key}_path={d}")
    for key in ("train", "validation"):
        f = tmp_path / f"{key}.parquet"
        f.touch()
        out.append(f"rl.data.{key}={f}")
    return out


def _no_launch(*_a, **_k):
    raise AssertionError("launched")


@pytest.mark.parametrize("command", ["run", "submit"])
def test_an_infeasible_config_is_refused_before_launch_in_one_line(
    command: str,
    planted: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import pivot_hpc.cli.local_world as local_world
    import pivot_hpc.cli.submit as submit

    monkeypatch.setattr(local_world, "launch", _no_launch)
    monkeypatch.setattr(submit, "submit", _no_launch)
    argv = [command, str(GROUPS[0]), "--run-dir", str(tmp_path / "run"), *planted]
    assert main([*argv, "rl.trainer.micro_batch_size=64"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("pivot-hpc: error: memory plan: training needs")
    assert "the H20 has 95.5 GiB" in err and "rl.trainer.micro_batch_size=1" in err
    assert not (tmp_path / "run").exists()


def test_plan_cli_json_and_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(GROUPS[0]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and set(out["roles"]) == {"rollout", "reward", "training", "shift"}
    assert main(["plan", str(GROUPS[0]), "rl.trainer.attention=local",
                 "rl.trainer.recompute=none"]) == 1  # fmt: skip
    text = capsys.readouterr().out
    assert "DOES NOT FIT: training" in text and "GiB per GPU" in text


def test_shipped_gpu_configs_size_the_kv_pool_from_free_memory() -> None:
    """A fixed mem_fraction_static makes a shift-up beside a still-resident trainer fail;
    the shipped configs leave it to the free-memory sizing (the knob stays)."""
    for path in GROUPS:
        cfg, _ = load_for_plan(str(path), [])
        assert cfg.engines.rollout.mem_fraction_static is None, path
        assert cfg.engines.reward.mem_fraction_static is None, path


def test_a_live_run_takes_the_distributed_optimizer_the_plan_sizes() -> None:
    """The plan divides the optimizer state by dp with it; the engine shards it
    (engines/megatron/sharded_adam.py), so the launch check passes it."""
    from pivot_hpc.runtime.world import check_live_config

    for flag in ("true", "false"):
        cfg, _ = load_for_plan(str(GROUPS[0]), [f"rl.trainer.distributed_optimizer={flag}"])
        check_live_config(cfg)
    cfg, _ = load_for_plan(str(GROUPS[0]), ["rl.trainer.distributed_optimizer=false"])
    check_live_config(cfg)
