"""Build a megatron-core GPTModel (local layer spec) that computes exactly the dense
decoder a `ModelConfig` describes: Qwen2, Qwen3 or Llama 3.

All three = RMSNorm, rotary embeddings (rotate-half), GQA attention, SwiGLU MLP without
bias, untied (or tied) output layer; Qwen2 adds a bias on q/k/v only, Qwen3 an RMSNorm on
each head's queries and keys (megatron's qk_layernorm), Llama 3 scales its rotary
frequencies (rope_type "llama3"). The same `ModelConfig` describes the HF model, so the
conversion in `convert.py` is total.
"""

from __future__ import annotations

import atexit
import datetime
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from pivot_hpc.engines.base import STORE_ENV
from pivot_hpc.engines.megatron import cpu_shim as megatron_cpu_shim
from pivot_hpc.models.config import ModelConfig


def private_store() -> str:
    """A rendezvous file in a new private (0700) directory, removed when the process ends."""
    d = tempfile.mkdtemp(prefix="pivot_pg_")
    atexit.register(shutil.rmtree, d, True)
    return os.path.join(d, "store")


def select_cuda_device(device: int | None = None) -> int:
    """The GPU this process trains on: `device`, else $LOCAL_RANK (torchrun, srun wrappers),
    else whatever the launcher already chose with `torch.cuda.set_device` /
    CUDA_VISIBLE_DEVICES (default 0). NCCL needs one distinct device per rank."""
    if device is None and "LOCAL_RANK" in os.environ:
        device = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
    if device is not None:
        torch.cuda.set_device(device)
    return torch.cuda.current_device()


def init_distributed(
    tp: int = 1,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    seed: int = 0,
    device: int | None = None,
    timeout_s: float = 1800.0,
) -> None:
    """Join (or create) the torch.distributed world and megatron's model-parallel groups.

    `timeout_s` (rl.trainer.collective_timeout_s): how long a collective waits for the
    other training ranks, e.g. at a checkpoint barrier while they finish inference.

    Without arguments and outside any launcher this makes a 1-process world (gloo on CPU,
    NCCL on a GPU), so a single process (tests, SFT warm-up, the embedded loop) runs real
    Megatron code. The world and the groups are made once per process; later calls (a
    second engine) reuse them. On CUDA `seed` seeds megatron's model-parallel RNG tracker
    (first call only); `device` picks the GPU (see `select_cuda_device`).
    """
    from megatron.core import parallel_state

    on_cpu = megatron_cpu_shim.apply()
    if not on_cpu:
        select_cuda_device(device)
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if init_method is None:
            if os.environ.get(STORE_ENV):
                init_method = f"file://{os.environ[STORE_ENV]}"
            elif "MASTER_ADDR" in os.environ:
                init_method = "env://"
            elif world_size == 1:
                init_method = f"file://{private_store()}"
            else:
                raise RuntimeError("init_distributed: pass init_method for a multi-process world")
        backend = "gloo" if on_cpu else "nccl"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tp:
            raise RuntimeError(f"model parallel already initialised with TP={have}, asked TP={tp}")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    if on_cpu:
        megatron_cpu_shim.reset_rng_tracker()
    else:
        from megatron.core import tensor_parallel

        # the real CUDA tracker: GPU weight init and attention's RNG fork need its
        # "model-parallel-rng" state (seed + 2718 + tp_rank, as megatron's training does)
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _recompute_args(recompute: str) -> dict:
    """megatron's activation recompute for rl.trainer.recompute: "selective" recomputes
    core attention in backward, "full" keeps only each layer's input (one layer per
    checkpoint) and runs the layer again in backward."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    raise ValueError(f"recompute={recompute!r}: valid: 'none', 'selective', 'full'")


def transformer_config(cfg: ModelConfig, tp: int, dtype: str = "fp32", recompute: str = "none"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = megatron_cpu_shim.needed()
    return TransformerConfig(
        **_recompute_args(recompute),
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_size(),
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=on_cpu,
        init_method_std=cfg.initializer_range,
        params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16",  # softmax casts its bf16 input to fp32 and back
        attention_softmax_in_fp32=True,
    )


def build_gpt_model(
    cfg: ModelConfig,
    tp: int = 1,
    dtype: str = "fp32",
    *,
    attention: str = "local",
    recompute: str = "none",
):
    """A GPTModel for this rank's tensor-parallel shard (call `init_distributed` first).

    On a GPU the weights are initialised on the current CUDA device (megatron's GPU init,
    seeded by `init_distributed`); on CPU with `use_cpu_initialization`. `dtype` "bf16"
    makes every parameter bf16 (what megatron's Float16Module does to a model).
    `attention` "sdpa" replaces the local spec's unfused core attention (engines/megatron/sdpa_attention.py);
    `recompute` is rl.trainer.recompute."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if dtype not in DTYPES:
        raise ValueError(f"build_gpt_model: dtype={dtype!r}; valid: {sorted(DTYPES)}")
    tcfg = transformer_config(cfg, tp, dtype, recompute)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_norm)
    if attention == "sdpa":
        from pivot_hpc.engines.megatron.sdpa_attention import sdpa_layer_spec

        spec = sdpa_layer_spec(spec)
    elif attention != "local":
        raise ValueError(f"build_gpt_model: attention={attention!r}; valid: 'local', 'sdpa'")
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        parallel_output=True,
    )
    if cfg.rope_llama3_factor:
        _scale_rotary(model, cfg)
    if dtype == "bf16":
        # the local spec's torch norms are created in fp32 whatever params_dtype says
        model = model.to(torch.bfloat16)
    if not megatron_cpu_shim.needed():
        model = model.cuda(torch.cuda.current_device())
    return model


def _scale_rotary(model, cfg: ModelConfig) -> None:
    """Llama 3's rope scaling with the directory's own parameters: megatron's
    `rope_scaling` takes the factor only and fixes the other three at Llama 3.1's values,
    so the frequencies are scaled here from the unscaled ones, exactly as transformers'
    `_compute_llama3_parameters` does."""
    rotary = model.rotary_pos_emb
    dim = cfg.head_size()
    base = 1.0 / (
        cfg.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rotary.inv_freq.device) / dim)
    )
    rotary.inv_freq = rotary._apply_scaling(
        base,
        factor=cfg.rope_llama3_factor,
        low_freq_factor=cfg.rope_llama3_low_freq_factor,
        high_freq_factor=cfg.rope_llama3_high_freq_factor,
        original_max_position_embeddings=cfg.rope_llama3_original_max_position,
    )


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's mask convention: True = masked out. Shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def position_ids(batch: int, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, -1)
