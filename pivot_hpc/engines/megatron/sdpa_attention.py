"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, as a
megatron-core module spec of ours (`rl.trainer.attention: sdpa`).

megatron's local layer spec (what runs without Transformer Engine) computes attention
unfused: it materialises the [batch·heads, s, s] score matrix and keeps the softmax for
backward — about 135 GB at 8K tokens for Qwen2.5-1.5B. SDPA picks a fused kernel (flash or
memory-efficient on a GPU) that never holds it, and on CPU computes the same function, so
the CPU tests compare it against the local spec. Everything else of the local spec
(projections, RoPE, norms, MLP) is unchanged; the module has no parameters, so weights
and checkpoints are the same under either spec.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPAttention(DotProductAttention):
    """DotProductAttention's interface ([s, b, heads, dim] in, [s, b, heads·dim] out, the
    same head partitioning and softmax scale), computed by SDPA. A mask equal to the
    causal one becomes `is_causal` (what the fused kernels want); any other mask is passed
    as it is (megatron's convention, True = masked, is inverted for SDPA)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias are not supported")
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        causal = _is_causal(attention_mask, sq, k.shape[2])
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal else ~attention_mask,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=groups > 1,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


_checked: dict[tuple, bool] = {}  # the last mask seen: every layer of a forward shares it


def _is_causal(mask: torch.Tensor | None, sq: int, sk: int) -> bool:
    """Whether `mask` (megatron: True = masked, broadcast over batch and heads) is exactly
    the causal mask, or absent (the causal layer's own default). Checked once per mask,
    not once per layer."""
    if mask is None:
        return True
    if sq != sk or mask.shape[-2:] != (sq, sk) or mask.shape[0] != 1 or mask.shape[1] != 1:
        return False
    key = (mask.data_ptr(), tuple(mask.shape), mask._version, str(mask.device))
    if key not in _checked:
        want = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
        _checked.clear()
        _checked[key] = bool(torch.equal(mask[0, 0].bool(), want))
    return _checked[key]


def sdpa_layer_spec(local_spec):
    """The local layer spec with core attention replaced by SDPAttention."""
    spec = copy.deepcopy(local_spec)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
