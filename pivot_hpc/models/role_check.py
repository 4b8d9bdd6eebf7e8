"""Each configured model directory checked for its roles before a launch (issue 46 #7).

`pivot-hpc run`, `submit` and slurm/pivot.sbatch (runtime/world.py `check_before_launch`)
and `pivot-hpc plan` ask here, so that a directory a role cannot use is one line naming
the directory, the config key and the fix (exit 2), never a traceback in a rank:

- readable: config.json and safetensors headers describe it (models/description.py);
- a tokenizer that loads, names an end-of-sequence token and fits the model's vocabulary:
  the runtime tokenizes prompts and judgements with the model's own (models/prompting.py);
- a weight dtype GPS stores (bf16, fp16, fp32);
- tensor-parallel sizes that cut each split tensor (the role's `tp`: rollout.tp for the
  policy's replicas, reward.tp for the GenRM's, rl.trainer.tp for training);
- an engine that runs its architecture: for `hf`, the model `transformers` builds from its
  config (on the meta device: no memory, no weights) is one the engine's loop runs and the
  directory's tensors fill it by name; vLLM and SGLang decide for themselves at load;
- for the policy, a training engine that trains it: Megatron's conversion
  (engines/megatron/convert.py) maps Qwen2/Qwen2.5, Qwen3 dense and Llama 3
  (models/trainable.py says what else in a config it refuses).

A directory the generated tiny models use (no `*_path` set) is not checked: it is ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivot_hpc.errors import ConfigError, PivotError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
STORED_DTYPES = ("bfloat16", "float16", "float32")


def check_model_dirs(cfg: Any, *, existing_only: bool = False) -> None:
    """Raise ConfigError (one line) for the first configured directory a role cannot use.
    `existing_only`: skip directories that are not on this machine (`plan` runs anywhere)."""
    m = cfg.models
    roles = (
        ("policy_path", m.policy_path, [("rollout", cfg.rollout.tp)], True),
        ("genrm_path", m.genrm_path, [("reward", cfg.reward.tp)], False),
    )
    for key, d, inference, trained in roles:
        if d is None or (existing_only and not Path(d).exists()):
            continue
        check_dir(cfg, f"models.{key}", Path(d), inference, trained)


def check_dir(cfg: Any, key: str, d: Path, inference: list[tuple[str, int]], trained: bool) -> None:
    from pivot_hpc.models.description import description_of

    def fail(why: str, fix: str) -> None:
        raise ConfigError(f"config key '{key}' = {str(d)!r}: {why}; {fix}")

    try:
        desc = description_of(d)
    except PivotError as exc:  # already names the file and the fix
        raise ConfigError(f"config key '{key}': {exc}") from None
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        fail(
            f"no tokenizer ({', '.join(TOKENIZER_FILES)})",
            "copy the model's tokenizer files into the directory",
        )
    why = _tokenizer_problem(d, desc)
    if why is not None:
        fail(why, "copy the tokenizer files that came with the model into the directory")
    if desc.weights_dtype not in STORED_DTYPES:
        fail(
            f"its weights are {desc.weights_dtype}",
            f"give a checkpoint in one of {', '.join(STORED_DTYPES)}",
        )
    arch = ", ".join(desc.architectures) or desc.model_type
    spec = _spec(desc)
    checks = [(f"{role}.tp", tp) for role, tp in inference]
    if trained:
        checks.append(("rl.trainer.tp", cfg.rl.trainer.tp))
    for tp_key, tp in checks:
        why = _tp_problem(spec, tp)
        if why is not None:
            fail(f"{tp_key}={tp} cannot cut {arch}: {why}", f"set {tp_key} to one of those")
    for role, _tp in inference:
        engine = getattr(cfg.engines, role).engine
        if engine == "hf":
            why = hf_problem(d, desc, getattr(cfg.engines, role).max_seq_len)
            if why is not None:
                fail(
                    f"{arch} cannot run on engines.{role}.engine=hf ({why})",
                    f"set engines.{role}.engine to vllm or sglang",
                )
    if trained and cfg.rl.trainer.engine == "megatron":
        why = _training_problem(d)
        if why is not None:
            fail(
                f"rl.trainer.engine=megatron cannot train {arch} ({why})",
                "train one of those families, or serve this model as models.genrm_path",
            )


def _tokenizer_problem(d: Path, desc) -> str | None:
    """Why the runtime cannot read and write this model's text with its tokenizer."""
    from pivot_hpc.models.prompting import load_prompter
    from pivot_hpc.models.safetensors_headers import ModelDirError

    try:
        p = load_prompter(d)
    except ModelDirError:
        return "no end-of-sequence token in its tokenizer, config.json or generation_config.json"
    except Exception as exc:  # whatever transformers raises for a broken tokenizer
        return f"its tokenizer does not load ({type(exc).__name__}: {str(exc)[:160]})"
    if len(p.tok) > desc.vocab_size:
        return (
            f"its tokenizer has {len(p.tok)} tokens, more than the model's vocab_size "
            f"{desc.vocab_size} (a token past it has no embedding)"
        )
    return None


def _training_problem(d: Path) -> str | None:
    from transformers import AutoConfig

    from pivot_hpc.models.trainable import training_problem

    return training_problem(AutoConfig.from_pretrained(str(d)))


def _spec(desc):
    from pivot_hpc.gps import ModelSpec

    return ModelSpec.from_description(desc, name="check")


def _tp_problem(spec, tp: int) -> str | None:
    from pivot_hpc.gps import Parallelism
    from pivot_hpc.gps.catalog import GPSError

    try:
        spec.check(Parallelism(tp=tp))
    except GPSError as exc:
        return str(exc).removeprefix("model 'check': ")
    return None


def hf_problem(d: Path, desc, max_seq_len: int | None = None) -> str | None:
    """Why the hf engine cannot serve directory `d` (None: it can): the model transformers
    builds from its config, on the meta device, checked as the engine checks it, and the
    directory's tensors checked against the names that model needs."""
    import torch

    from pivot_hpc.engines.hf.engine import unsupported
    from pivot_hpc.models.hf_load import WeightMap, build_model

    try:
        with torch.device("meta"):
            model = build_model(d)
    except PivotError as exc:
        return str(exc)
    why = unsupported(model, max_seq_len or desc.max_position_embeddings)
    if why is not None:
        return why
    try:
        WeightMap(model, desc.names).check(desc.names, "its safetensors")
    except PivotError as exc:
        return str(exc)
    return None
