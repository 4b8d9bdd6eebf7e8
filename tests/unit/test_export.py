"""`pivot-hpc export RUN_DIR --out DIR [--step N]` (cli/export.py): a checkpoint's policy
as a Hugging Face directory. Tiny random-init directories of real architectures (a tied
Qwen2, Qwen3, Llama 3) stand for the policy; the exported directory loads in `transformers`
with the checkpoint's weights (logits equal to a model holding those tensors), the chosen
step's, tied embeddings tied. What cannot be exported is one line and exit 2, and nothing
is left at --out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pivot_hpc.cli.main import main
from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir
from tests.export_support import write_checkpoint

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])


def logits_of(model_dir: Path, tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if tensors is not None:  # the reference: the base model holding the checkpoint's tensors
        missing, unexpected = model.load_state_dict(
            {k: v.float() for k, v in tensors.items()}, strict=False
        )
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        model.tie_weights()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture
def run_dir(tmp_path: Path):
    def make(arch: str) -> tuple[Path, Path, dict[int, dict[str, torch.Tensor]]]:
        base = build_arch_dir(arch, tmp_path / "base", dtype="bfloat16")
        run = tmp_path / "run"
        steps = {s: write_checkpoint(run, base, s, seed=s) for s in (3, 5)}
        return run, base, steps

    return make


@pytest.mark.parametrize("arch", ["qwen2-tied", "qwen3", "llama3"])
def test_the_newest_checkpoint_loads_in_transformers_with_its_weights(
    run_dir, tmp_path: Path, arch: str, capsys
) -> None:
    run, base, steps = run_dir(arch)
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "exported step 5" in line and str(out) in line and "from_pretrained" in line
    assert torch.equal(logits_of(out), logits_of(base, steps[5]))
    assert not torch.equal(logits_of(out), logits_of(base))  # the trained weights, not the base
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16  # as stored: no silent upcast
    if arch == "qwen2-tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == model.generation_config.eos_token_id


def test_step_picks_an_older_checkpoint(run_dir, tmp_path: Path) -> None:
    run, base, steps = run_dir("qwen3")
    out = tmp_path / "step3"
    assert main(["export", str(run), "--out", str(out), "--step", "3"]) == 0
    assert torch.equal(logits_of(out), logits_of(base, steps[3]))


def refused(argv: list[str], capsys) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pivot-hpc: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_what_cannot_be_exported_is_one_line_and_leaves_nothing(
    run_dir, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    assert "no such directory" in refused([str(tmp_path / "nope"), "--out", str(out)], capsys)
    (tmp_path / "empty-run").mkdir()
    assert "no complete checkpoint" in refused(
        [str(tmp_path / "empty-run"), "--out", str(out)], capsys
    )
    run, _, _ = run_dir("qwen2-tied")
    err = refused([str(run), "--out", str(out), "--step", "4"], capsys)
    assert "--step 4" in err and "[3, 5]" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert "not empty" in refused([str(run), "--out", str(busy)], capsys)
    assert (busy / "keep.txt").read_text() == "mine"
    assert "parent" in refused([str(run), "--out", str(tmp_path / "a" / "b")], capsys)
    # a checkpoint whose weights changed after it was written: refused by its manifest
    weights = sorted(run.glob("checkpoints/ckpt-*/policy/model.safetensors"))[-1]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    err = refused([str(run), "--out", str(out)], capsys)
    assert "model.safetensors" in err and "--step exports another one (steps [3])" in err
    assert not out.exists() and not list(tmp_path.glob(".out.export-*"))
    # an empty --out directory is fine (a job script may have made it)
    out.mkdir()
    assert main(["export", str(run), "--out", str(out), "--step", "3"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
