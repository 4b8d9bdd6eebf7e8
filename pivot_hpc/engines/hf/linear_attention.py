"""Linear-attention layers of hybrid decoders in the hf engine: Gated DeltaNet, the
`linear_attn` of Qwen3.5 and Qwen3.5-MoE (3 of every 4 layers of Qwen3.5-122B-A10B).

Such a layer keeps no per-token K/V: each sequence carries a short convolution window (the
last `conv_kernel_size` inputs of its causal conv) and one recurrent state per head
(head_k_dim × head_v_dim). Both live here per KV slot, moved with the slot when the engine
compacts its slots. A prompt is prefilled alone (the engine gives a hybrid model one
sequence per prefill chunk): the chunked delta rule's final state is exact only without
padding after the sequence's end. A decode step advances every running sequence by one
token with the recurrent rule. The arithmetic is the model module's own
(`causal_conv1d_fn`/`_update`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule` of its `transformers` file), so the engine computes what
`transformers`' forward computes.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

# what a Gated DeltaNet module must have for this path (Qwen3-Next fuses its projections
# into in_proj_qkvz / in_proj_ba: refused by the engine's check, not guessed here)
MODULE_PARTS = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
)
LIBRARY_PARTS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
)


def problem(module) -> str | None:
    """Why this path cannot run a `linear_attn` module (None: it can)."""
    missing = [p for p in MODULE_PARTS if not hasattr(module, p)]
    if missing:
        return f"its linear attention ({type(module).__name__}) has no {missing}"
    lib = sys.modules[type(module).__module__]
    missing = [p for p in LIBRARY_PARTS if not hasattr(lib, p)]
    if missing:
        return f"its linear attention's module defines no {missing}"
    return None


class LinearStates:
    """Conv windows and recurrent states of the linear-attention layers, per KV slot."""

    def __init__(self, layers: dict[int, object], device: torch.device) -> None:
        self.layers = layers  # layer index -> its linear_attn module
        self.device = device
        self.conv: dict[int, torch.Tensor] = {}
        self.rec: dict[int, torch.Tensor] = {}
        self.slots = 0

    def reset(self) -> None:
        self.conv, self.rec, self.slots = {}, {}, 0

    def ensure(self, slots: int) -> None:
        """Room for `slots` sequences (what is there is kept)."""
        for states in (self.conv, self.rec):
            for li, t in states.items():
                if t.shape[0] < slots:
                    grown = t.new_zeros((slots, *t.shape[1:]))
                    grown[: t.shape[0]] = t
                    states[li] = grown
        self.slots = max(self.slots, slots)

    def move(self, dst: int, src: int) -> None:
        for states in (self.conv, self.rec):
            for t in states.values():
                t[dst] = t[src]

    def _store(self, states: dict[int, torch.Tensor], li: int, slot: int, value: torch.Tensor):
        if li not in states:
            states[li] = value.new_zeros((max(self.slots, slot + 1), *value.shape))
        states[li][slot] = value

    def prefill(self, li: int, h: torch.Tensor, slot: int) -> torch.Tensor:
        """The layer's output for one whole sequence `h` [1, L, hidden] from empty states;
        its final states are kept in `slot`."""
        mod = self.layers[li]
        lib = sys.modules[type(mod).__module__]
        mixed, z, beta, g = _project(mod, h)
        k = mod.conv_kernel_size
        self._store(self.conv, li, slot, F.pad(mixed, (max(0, k - mixed.shape[-1]), 0))[0, :, -k:])
        w = mod.conv1d.weight.squeeze(1)
        mixed = lib.causal_conv1d_fn(mixed, w, mod.conv1d.bias, activation=mod.activation)
        q, key, v = _split(mod, mixed)
        core, last = lib.torch_chunk_gated_delta_rule(
            q, key, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        self._store(self.rec, li, slot, last[0])
        return _output(mod, core, z)

    def decode(self, li: int, h: torch.Tensor) -> torch.Tensor:
        """One token for each of the first n slots: `h` [n, 1, hidden]."""
        mod = self.layers[li]
        lib = sys.modules[type(mod).__module__]
        n = h.shape[0]
        mixed, z, beta, g = _project(mod, h)
        window = self.conv[li][:n]  # updated in place by the module's own step
        w = mod.conv1d.weight.squeeze(1)
        mixed = lib.causal_conv1d_update(mixed, window, w, mod.conv1d.bias, mod.activation)
        q, key, v = _split(mod, mixed)
        core, last = lib.torch_recurrent_gated_delta_rule(
            q,
            key,
            v,
            g=g,
            beta=beta,
            initial_state=self.rec[li][:n],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        self.rec[li][:n] = last
        return _output(mod, core, z)


def _project(mod, h: torch.Tensor):
    b, n, _ = h.shape
    mixed = mod.in_proj_qkv(h).transpose(1, 2)  # [b, conv channels, n]
    z = mod.in_proj_z(h).reshape(b, n, -1, mod.head_v_dim)
    beta = mod.in_proj_b(h).sigmoid()
    # (in fp32: in half precision A may be -inf, as the module's own comment says)
    g = -mod.A_log.float().exp() * F.softplus(mod.in_proj_a(h).float() + mod.dt_bias)
    return mixed, z, beta, g


def _split(mod, mixed: torch.Tensor):
    mixed = mixed.transpose(1, 2)
    b, n, _ = mixed.shape
    q, k, v = torch.split(mixed, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(b, n, -1, mod.head_k_dim)
    k = k.reshape(b, n, -1, mod.head_k_dim)
    v = v.reshape(b, n, -1, mod.head_v_dim)
    groups = mod.num_v_heads // mod.num_k_heads
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return q, k, v


def _output(mod, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    b, n = z.shape[:2]
    out = mod.norm(core.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim))
    return mod.out_proj(out.reshape(b, n, -1))
