"""Weight updates for the `sglang` engine: GPS tensors → flattened buckets → per-rank payloads.

SGLang 0.5.23 loads a weight update with `Engine.update_weights_from_tensor(named_tensors,
load_format="flattened_bucket")`: each TP rank deserializes its own payload
(`tp_worker.deserialize_own_rank`) and rebuilds the tensors of one bucket
(`FlattenedTensorBucket(flattened_tensor=..., metadata=...).reconstruct_tensors()`,
`model_runner_components/weight_updater.py:_update_weights_from_flattened_bucket`), then
calls the model's `load_weights`, the same path that loads a checkpoint from disk.

- Buckets bound the staging memory of one call by `max_bytes`. Each bucket holds one dtype:
  the bucket is a uint8 buffer that is viewed back as each tensor's dtype, and a view needs
  a byte offset that is a multiple of the item size. Mixing a bf16 tensor of odd length with
  a float32 one would break that.
- Tensors travel as CPU shared memory (torch's ForkingPickler shares the storage by file
  descriptor; SGLang's SafeUnpickler allows `rebuild_storage_fd` / `DupFd`): each bucket
  takes its size in /dev/shm, and the receiving TP ranks fetch the descriptor from this
  process while they unpickle. So the producer keeps a bucket's flattened tensor alive
  until `update_weights_from_tensor` has returned (`SerializedBucket.keepalive`, as slime's
  `update_weight_from_tensor.py` does), and one bucket at a time. CUDA IPC would save one
  copy but the producer would have to keep every bucket alive until the scheduler's
  asynchronous device copies finish, which SGLang does not signal.
- One serialized payload per TP rank, as `Engine._serialize_tensors_per_rank` does for the
  other formats: a shared-memory descriptor (like a CUDA IPC handle) is consumed once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Serializer(Protocol):
    def serialize(self, obj: Any, output_str: bool = False) -> Any: ...


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Group tensor names into buckets of one dtype and at most `max_bytes` each.

    A tensor larger than `max_bytes` travels alone. Within a dtype the names keep the
    mapping's order, so a plan is deterministic for a given state dict."""
    if max_bytes < 1:
        raise ValueError(f"plan_buckets: max_bytes={max_bytes} must be >= 1")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    buckets: list[list[str]] = []
    for names in by_dtype.values():
        cur: list[str] = []
        cur_bytes = 0
        for name in names:
            n = tensor_nbytes(tensors[name])
            if cur and cur_bytes + n > max_bytes:
                buckets.append(cur)
                cur, cur_bytes = [], 0
            cur.append(name)
            cur_bytes += n
        if cur:
            buckets.append(cur)
    return buckets


def bucket_payload(named: list[tuple[str, torch.Tensor]], bucket_cls: Callable[..., Any]) -> dict:
    """The dict one TP rank deserializes for load_format="flattened_bucket"."""
    # CPU and detached: the payload crosses as shared memory (see the module docstring).
    cpu = [(name, t.detach().to("cpu")) for name, t in named]
    bucket = bucket_cls(named_tensors=cpu)
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def bucket_nbytes(tensors: Mapping[str, torch.Tensor], names: list[str]) -> int:
    return sum(tensor_nbytes(tensors[n]) for n in names)


@dataclass(frozen=True)
class SerializedBucket:
    payloads: list[Any]  # one per TP rank: `named_tensors` of update_weights_from_tensor
    last: bool  # the last bucket of the update
    nbytes: int  # its size (what it takes in /dev/shm)
    keepalive: Any  # the flattened tensor the payloads point at: alive until the call returns


def serialized_buckets(
    tensors: Mapping[str, torch.Tensor],
    *,
    plan: list[list[str]],
    tp_size: int,
    bucket_cls: Callable[..., Any],
    serializer: Serializer,
) -> Iterator[SerializedBucket]:
    """One SerializedBucket per bucket of `plan` (`plan_buckets`). Lazy, so one bucket's
    staging copy is alive at a time; the caller holds the yielded bucket until SGLang has
    taken it (the generator's own reference ends when it is resumed)."""
    if tp_size < 1:
        raise ValueError(f"serialized_buckets: tp_size={tp_size} must be >= 1")
    for i, names in enumerate(plan):
        payload = bucket_payload([(n, tensors[n]) for n in names], bucket_cls)
        yield SerializedBucket(
            payloads=[serializer.serialize(payload) for _ in range(tp_size)],
            last=i == len(plan) - 1,
            nbytes=bucket_nbytes(tensors, names),
            keepalive=payload["flattened_tensor"],
        )
        del payload
