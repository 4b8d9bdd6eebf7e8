"""Build a megatron-core GPTModel (local layer spec) that computes exactly Qwen2.

Qwen2 = RMSNorm, rotary embeddings (rotate-half), GQA attention with bias on q/k/v only,
SwiGLU MLP without bias, untied (or tied) output layer. The same `ModelConfig` that
creates the HF model creates this one, so the conversion in `convert.py` is total.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist

from pivot_hpc.engines import megatron_cpu_shim
from pivot_hpc.models.config import ModelConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(
    tp: int = 1,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> None:
    """Join (or create) the torch.distributed world and megatron's model-parallel groups.

    Without arguments and outside any launcher this makes a 1-process gloo world, so a
    single process (tests, SFT warm-up, the embedded loop) runs real Megatron code.
    """
    from megatron.core import parallel_state

    megatron_cpu_shim.apply()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if init_method is None:
            if "MASTER_ADDR" in os.environ:
                init_method = "env://"
            elif world_size == 1:
                init_method = f"file://{tempfile.mkdtemp(prefix='pivot_pg_')}/store"
            else:
                raise RuntimeError("init_distributed: pass init_method for a multi-process world")
        backend = "gloo" if megatron_cpu_shim.needed() else "nccl"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tp:
            raise RuntimeError(f"model parallel already initialised with TP={have}, asked TP={tp}")
        return
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    megatron_cpu_shim.reset_rng_tracker()


def transformer_config(cfg: ModelConfig, tp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = megatron_cpu_shim.needed()
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.hidden_size // cfg.num_heads,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=True,
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
        params_dtype=torch.float32,
        attention_softmax_in_fp32=True,
    )


def build_gpt_model(cfg: ModelConfig, tp: int = 1):
    """A GPTModel for this rank's tensor-parallel shard (call `init_distributed` first)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tcfg = transformer_config(cfg, tp)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        parallel_output=True,
    )
    if not megatron_cpu_shim.needed():
        model = model.cuda()
    return model


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's mask convention: True = masked out. Shape [1, 1, s, s]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


def position_ids(batch: int, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, -1)
