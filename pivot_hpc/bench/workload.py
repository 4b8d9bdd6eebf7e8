"""Realistic planner snapshots for benchmarks: an N-GPU cluster in the middle of an RL step.

Shape (issue "Foundation and control-plane core"): rollout replicas of 1 GPU, reward
replicas of 4 GPUs, a training set of N/4 GPUs that holds its GPUs idle while its next
batch is not ready, and thousands of running and queued sequences whose lengths are
long-tailed (log-normal, capped at the paper's 15K policy / 20K GenRM tokens).

Throughput constants are first-principles numbers for an H20 (4.0 TB/s HBM, 148 TFLOP/s
bf16): A = KV bytes per token / HBM bandwidth, B = weight bytes / HBM bandwidth,
C = 2·active params / peak FLOP/s, D = a fixed per-step overhead. Rollout is Qwen2.5-7B at
TP=1, reward Qwen3-30B-A3B at TP=4 (bandwidth and FLOP/s ×4).
"""

from __future__ import annotations

import numpy as np

from pivot_hpc.errors import UsageError
from pivot_hpc.planner.config import ShiftTimes
from pivot_hpc.planner.snapshot import Snapshot, Topology, TrainingState, replica_id
from pivot_hpc.scheduler import Scheduler, SeqState, ThroughputModel

HBM = 4.0e12
FLOPS = 148e12

ROLLOUT_MODEL = ThroughputModel(
    A=2 * 28 * 4 * 128 * 2 / HBM,  # Qwen2.5-7B: 28 layers, 4 KV heads, head dim 128, bf16
    B=15.2e9 / HBM,
    C=2 * 7.6e9 / FLOPS,
    D=2e-3,
)
REWARD_MODEL = ThroughputModel(
    A=2 * 48 * 4 * 128 * 2 / (4 * HBM),  # Qwen3-30B-A3B at TP=4
    B=61e9 / (4 * HBM),
    C=2 * 3.3e9 / (4 * FLOPS),
    D=3e-3,
)
ROLLOUT_KV = 1_000_000  # tokens per 1-GPU replica (96 GB − weights − workspace)
REWARD_KV = 600_000  # tokens per 4-GPU replica (GenRM contexts are long: it queues)


def _lengths(rng: np.random.Generator, n: int, median: float, cap: int, prompt: tuple[int, int]):
    gen = np.minimum(rng.lognormal(np.log(median), 1.0, n), cap).astype(int)
    return gen + rng.integers(prompt[0], prompt[1], n)


def realistic_snapshot(gpus: int, seed: int = 0) -> Snapshot:
    """A mid-step snapshot of a `gpus`-GPU cluster (multiple of 8; 8 GPUs per node)."""
    if gpus < 8 or gpus % 8:
        raise UsageError(f"--gpus {gpus}: use a multiple of 8 (8 GPUs per node), at least 8")
    rng = np.random.default_rng(seed)
    train = gpus // 4
    topo = Topology.build(
        num_gpus=gpus,
        gpus_per_node=8,
        tp={"rollout": 1, "reward": 4},
        kv_capacity={"rollout": ROLLOUT_KV, "reward": REWARD_KV},
        models={"rollout": ROLLOUT_MODEL, "reward": REWARD_MODEL},
        training_gpus=list(range(gpus - train, gpus)),
        shift_time=ShiftTimes(rollout=1.5, reward=3.0, training=5.0),
    )
    free = gpus - train
    # Roughly half the inference GPUs roll out, the rest judge (4-GPU blocks), a few idle.
    reward_blocks = max(1, int(free / 4 * rng.uniform(0.35, 0.6)))
    rollout_gpus = free - reward_blocks * 4 - int(rng.integers(0, 3))
    rollout = Scheduler("rollout")
    reward = Scheduler("reward")
    for g in range(rollout_gpus):
        rollout.add_replica(replica_id("rollout", g), ROLLOUT_KV, ROLLOUT_MODEL)
    first_block = (gpus - train) // 4 - reward_blocks
    for b in range(first_block, first_block + reward_blocks):
        reward.add_replica(replica_id("reward", b), REWARD_KV, REWARD_MODEL)

    seq_id = 0
    # Long-tail phase of rollout: few sequences per replica, some replicas already idle.
    n_roll = int(rollout_gpus * rng.uniform(4, 12))
    for length in _lengths(rng, n_roll, 3000, 15000, (200, 2000)):
        rollout.submit(SeqState(seq_id, int(length)))
        seq_id += 1
    rollout.dispatch()
    # Reward is busy: judging responses (prompt + response) and writing rationales.
    n_rew = int(reward_blocks * rng.uniform(30, 90))
    for length in _lengths(rng, n_rew, 4000, 20000, (2000, 8000)):
        reward.submit(SeqState(seq_id, int(length)))
        seq_id += 1
    reward.dispatch()
    # Finished responses keep arriving at reward; what does not fit waits in its queue.
    for length in _lengths(rng, int(reward_blocks * rng.uniform(0, 40)), 4000, 20000, (2000, 8000)):
        reward.submit(SeqState(seq_id, int(length)))
        seq_id += 1
    reward.dispatch()
    return Snapshot(
        topology=topo,
        schedulers={"rollout": rollout, "reward": reward},
        training=TrainingState(active=True, busy=False, batch_ready=False),
    )
