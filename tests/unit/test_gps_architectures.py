"""GPS on real architectures: a model's own tensors under their Hugging Face names.

For every tiny architecture (recipes/tiny_arch_dirs.py) the in-process executor of
test_gps_plan.py plays GPS's plans between numpy "node buffers" and rank arenas: the
checkpoint loaded as `GlobalParameterStorage.load` does it (tensor by tensor through
models/weights.TensorReader), a Write from one tensor-parallel layout, a Read at another,
and every shard compared with the checkpoint's bytes cut by an oracle written from the
layouts' meaning (heads, KV heads replicated, [gate_r; up_r], [q_r; k_r; v_r]), not from
GPS's rule code. tests/mpi/test_gps_architectures_mpi.py does the same through MPI.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from pivot_hpc.gps import GPSConfig, ModelSpec, Parallelism
from pivot_hpc.gps.layout import HostLayout
from pivot_hpc.gps.links import LinkModel
from pivot_hpc.gps.plan import build_read_plan, build_write_plan
from pivot_hpc.models.weights import TensorReader
from pivot_hpc.recipes.tiny_arch_dirs import ARCHITECTURES
from tests.gps_oracle import checkpoint, expected

NODES = 2
NODE_OF = np.repeat(np.arange(NODES), 4)  # 8 ranks, 4 per node


def fill(layout: HostLayout, model: str, spec: ModelSpec, get, slot: int) -> list[np.ndarray]:
    """Node buffers holding the model in `slot`, filled as store._load_local fills them."""
    bufs = []
    for n in range(layout.num_nodes):
        m = layout.member_of(n)
        buf = np.zeros(int(layout.node_bytes[m]), np.uint8)
        for ti, t in enumerate(spec.tensors):
            full = as_bytes(get(t.name), t)
            row = t.cols * t.itemsize
            b = layout.bounds[model][ti]
            blk = full[b[m] * row : b[m + 1] * row]
            off = layout.offsets[model][m, slot, ti]
            buf[off : off + blk.size] = blk
        bufs.append(buf)
    return bufs


def _runs(plan, layout, model, slot, bufs, j):
    t, m, n = plan.op_tensor[j], plan.op_member[j], plan.op_node[j]
    nr, rb, st = plan.op_nrows[j], plan.op_row_bytes[j], plan.op_stride[j]
    host = as_strided(bufs[n][layout.offsets[model][m, slot, t] + plan.op_host_off[j] :],
                      shape=(nr, rb), strides=(st, 1))  # fmt: skip
    return t, host, nr * rb


def play_write(plan, layout, model, slot, bufs, shards: list[dict[str, np.ndarray]]) -> None:
    for i, sh in enumerate(plan.shards):
        arena = np.zeros(sh.arena_bytes, np.uint8)
        for p, name in enumerate(sh.names):
            raw = np.ascontiguousarray(shards[i][name]).reshape(-1).view(np.uint8)
            assert raw.size == sh.nbytes[p], (name, raw.size, sh.nbytes[p])
            arena[sh.offsets[p] : sh.offsets[p] + raw.size] = raw
        for j in range(plan.ops(i).start, plan.ops(i).stop):
            t, host, nb = _runs(plan, layout, model, slot, bufs, j)
            a = sh.offsets[sh.pos[t]] + plan.op_shard_off[j]
            host[:] = arena[a : a + nb].reshape(host.shape)


def play_read(plan, layout, model, slot, bufs, i) -> dict[str, np.ndarray]:
    sh = plan.shards[i]
    arena = np.zeros(sh.arena_bytes, np.uint8)
    for j in range(plan.ops(i).start, plan.ops(i).stop):
        t, host, nb = _runs(plan, layout, model, slot, bufs, j)
        a = sh.offsets[sh.pos[t]] + plan.op_shard_off[j]
        arena[a : a + nb].reshape(host.shape)[:] = host
    return {
        name: arena[sh.offsets[p] : sh.offsets[p] + sh.nbytes[p]]
        .view(sh.dtypes[p])
        .reshape(sh.shapes[p])
        for p, name in enumerate(sh.names)
    }


def as_bytes(a, t) -> np.ndarray:
    """A full tensor's bytes, checked like store._as_bytes (store imports MPI)."""
    import torch

    if isinstance(a, torch.Tensor):
        a = (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy()
    assert tuple(a.shape) == t.shape and a.itemsize == t.itemsize, t.name
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def same(got: dict, exp: dict, what: str) -> None:
    assert sorted(got) == sorted(exp), what
    for n, e in exp.items():
        assert got[n].shape == e.shape, (what, n, got[n].shape, e.shape)
        assert got[n].tobytes() == np.ascontiguousarray(e).tobytes(), (what, n)


LAYOUTS = [Parallelism(tp=1), Parallelism(tp=2), Parallelism(tp=4), Parallelism(tp=2, pp=2)]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_write_then_read_returns_the_checkpoints_bytes(arch, k, arch_dirs):
    d = arch_dirs[arch]
    spec = ModelSpec.from_dir(d, name=arch)
    ckpt = checkpoint(d)
    assert [t.name for t in spec.tensors] == list(ckpt)  # exactly what the files hold
    layout = HostLayout({"p": spec}, {"p"}, NODES, k)
    links = LinkModel.from_config(GPSConfig(), NODES)
    with TensorReader(d) as get:
        loaded = fill(layout, "p", spec, get, slot=0)
    for par in LAYOUTS:  # the load, read back at every layout
        plan = build_read_plan("p", spec, layout, NODE_OF, tuple(range(par.size)), par, links)
        for i in range(par.size):
            same(play_read(plan, layout, "p", 0, loaded, i), expected(spec, ckpt, par, i),
                 f"{arch} load, read {par} rank {i}")  # fmt: skip
    for wpar in LAYOUTS:  # a Write from one layout into the other slot, Reads at all
        bufs = [np.zeros_like(b) for b in loaded]
        ranks = tuple(range(8 - wpar.size, 8))
        wplan = build_write_plan("p", spec, layout, NODE_OF, ranks, wpar, links)
        play_write(wplan, layout, "p", 1, bufs, [expected(spec, ckpt, wpar, i) for i in range(wpar.size)])  # fmt: skip
        for par in LAYOUTS:
            plan = build_read_plan("p", spec, layout, NODE_OF, tuple(range(par.size)), par, links)
            for i in range(par.size):
                same(play_read(plan, layout, "p", 1, bufs, i), expected(spec, ckpt, par, i),
                     f"{arch} write {wpar}, read {par} rank {i}")  # fmt: skip


def test_kv_heads_fewer_than_tp_are_replicated(tmp_path):
    from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir

    d = build_arch_dir("phi3", tmp_path / "phi3", num_key_value_heads=2)  # fused qkv, 2 KV heads
    spec = ModelSpec.from_dir(d)
    ckpt = checkpoint(d)
    layout = HostLayout({"p": spec}, {"p"}, NODES, 2)
    links = LinkModel.from_config(GPSConfig(), NODES)
    bufs = fill(layout, "p", spec, ckpt.__getitem__, slot=0)
    par = Parallelism(tp=4, dp=2)
    plan = build_read_plan("p", spec, layout, NODE_OF, tuple(range(8)), par, links)
    for i in range(8):
        same(play_read(plan, layout, "p", 0, bufs, i), expected(spec, ckpt, par, i), f"rank {i}")
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    t = spec.tensors[spec.index[qkv]]
    assert spec.shard_shape(t, 4, 3) == (2 * 16 + 16 + 16, 128)  # 2 q heads, 1 k, 1 v


def test_tied_models_hold_no_lm_head(arch_dirs):
    spec = ModelSpec.from_dir(arch_dirs["qwen2-tied"], name="policy")
    assert "lm_head.weight" not in spec.index and spec.tie_word_embeddings
    emb = spec.tensors[spec.index["model.embed_tokens.weight"]]
    assert spec.stages_of(emb, 2) == (0, 1)  # the last stage's output layer
    untied = ModelSpec.from_dir(arch_dirs["qwen2"])
    assert untied.stages_of(untied.tensors[untied.index["model.embed_tokens.weight"]], 2) == (0,)


def test_optimizer_state_models_keep_the_tensor_list(arch_dirs):
    from pivot_hpc.runtime.training_world import optimizer_models

    policy = ModelSpec.from_dir(arch_dirs["qwen3-moe"], name="policy")
    for name, m in optimizer_models(policy, masters=True).items():
        assert m.name == name and m.dtype == "float32"
        assert [t.name for t in m.tensors] == [t.name for t in policy.tensors]
        assert {t.dtype for t in m.tensors} == {"float32"}
        assert m.nbytes == 2 * policy.nbytes
    again = dataclasses.replace(policy, name="x")
    assert again.tensors == policy.tensors


def test_catalog_models_and_directories_agree_on_a_dense_model(arch_dirs):
    d = ModelSpec.from_dir(arch_dirs["qwen2"])
    cfg = json.loads((arch_dirs["qwen2"] / "config.json").read_text())
    dense = ModelSpec.from_hf_config(cfg)  # the catalog's dense list from the same numbers
    by_name = {t.name: t for t in dense.tensors}
    assert sorted(by_name) == sorted(t.name for t in d.tensors)
    for t in d.tensors:
        c = by_name[t.name]
        assert (t.shape, t.rule, t.layer, t.part) == (c.shape, c.rule, c.layer, c.part)
