"""The `hf` engine over real architectures (recipes/tiny_arch_dirs.py, built offline):
built with `transformers`' Auto classes from each directory's config, weights by
checkpoint name; its logprobs of a generated sequence equal a plain `transformers`
forward of the same directory, and weights handed over under the checkpoint's names (as
GPS holds them: a MoE's experts one by one, a tied head absent, a multimodal checkpoint's
decoder under model.language_model.) load in place. Qwen3.5's hybrid layers keep their
linear-attention states per sequence (engines/hf/linear_attention.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.engines.hf.engine import UnsupportedModelError, generate_all, make_hf_engine
from pivot_hpc.models.hf_load import ModelBuildError, build_model
from pivot_hpc.models.weights import TensorReader
from pivot_hpc.recipes.tiny_arch_dirs import BASE, QWEN35_TEXT, build_arch_dir, create_arch_model

RUNS = (
    "qwen2",
    "qwen2-tied",
    "qwen3",
    "llama3",
    "glm4",
    "qwen3-moe",
    "phi3",
    "qwen3.5-moe",  # Gated DeltaNet linear attention beside gated full attention
    "qwen3.5-moe-vl",  # the same decoder under model.language_model., a vision tower beside
)
N = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
PROMPTS = [[1, 20, 21, 22, 30], [1, 40, 41], [1, 50, 60, 70, 80, 90, 33]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_archs")
    return {a: build_arch_dir(a, root / a, seed=5) for a in RUNS}


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("arch", RUNS)
def test_logprobs_equal_a_transformers_forward(dirs, arch):
    engine = make_hf_engine(str(dirs[arch]), kv_capacity_tokens=4096)
    # the causal LM of the text decoder (of a multimodal checkpoint's too)
    want = type(create_arch_model(arch)).__name__.replace("ForConditionalGeneration", "ForCausalLM")
    assert type(engine.model).__name__ == want
    reference = create_arch_model(arch, seed=5)  # the directory's own weights
    res = generate_all(engine, PROMPTS, GREEDY)
    worst = 0.0
    for r, p in zip(res, PROMPTS, strict=True):
        lp = _forward_logprobs(reference, p, r.token_ids)
        worst = max(worst, (lp - torch.tensor(r.logprobs)).abs().max().item())
    assert worst <= 1e-4, f"{arch}: logprobs differ by {worst}"
    assert len({tuple(r.token_ids) for r in res}) > 1  # not degenerate


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-tied", "glm4", "qwen3.5-moe-vl"])
def test_weights_by_checkpoint_name_load_in_place(dirs, arch):
    """GPS hands the engine the directory's tensors under their own names."""
    engine = make_hf_engine(str(dirs[arch]))
    before = generate_all(engine, PROMPTS, GREEDY)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    with TensorReader(dirs[arch]) as reader:
        tensors = {n: reader(n) for n in reader.description.names}
    if arch == "qwen2-tied":
        assert "lm_head.weight" not in tensors
    engine.release_memory(weights=True)
    engine.resume_memory()
    engine.load_weights(tensors, version=3)
    after = generate_all(engine, PROMPTS, GREEDY, first_id=100)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert all(r.version == 3 for r in after)
    del tensors[next(n for n in tensors if "layers.1." in n)]
    with pytest.raises(ModelBuildError, match="missing tensors"):
        engine.load_weights(tensors, version=4)


def test_a_hybrid_models_states_follow_their_sequences(dirs):
    """More sequences than slots, ending at different lengths: slots are reused and
    compacted, each linear-attention state moving with its sequence; every sequence gets
    the tokens and logprobs it gets alone."""
    d = str(dirs["qwen3.5-moe"])
    cases = [([1, 20 + i, 21, 22 + 2 * i][: 2 + i % 3], 3 + 2 * i) for i in range(7)]

    def sampling(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    alone = [generate_all(make_hf_engine(d), [p], sampling(n))[0] for p, n in cases]
    engine = make_hf_engine(d, max_batch=3)
    for i, (p, n) in enumerate(cases):
        engine.add(i, p, sampling=sampling(n))
    out = {}
    while engine.has_unfinished():
        for r in engine.step():
            out[r.seq_id] = r
    for i, r in enumerate(alone):
        assert out[i].token_ids == r.token_ids
        assert out[i].logprobs == pytest.approx(r.logprobs, abs=1e-5)


def test_a_linear_attention_it_does_not_know_is_refused_in_one_line(tmp_path):
    import transformers as tf

    from pivot_hpc.models.tokenizer import build_tokenizer

    config = tf.Qwen3NextConfig(
        **BASE,
        **QWEN35_TEXT,  # Qwen3.5's linear-attention sizes; Qwen3-Next fuses its projections
    )
    tf.Qwen3NextForCausalLM(config).save_pretrained(tmp_path)  # in_proj_qkvz: fused
    build_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="in_proj_qkv.*vllm or sglang"):
        make_hf_engine(str(tmp_path))


def test_unknown_model_type_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ModelBuildError, match="config.json: transformers cannot read"):
        build_model(tmp_path)
