"""The runtime's layout is node-major (issue 48): the first ranks_per_node ranks on the
first node, and so on. A launch that places them otherwise (srun --distribution=cyclic, a
site's SLURM_DISTRIBUTION) is refused at start in one line naming the ranks and the fix,
instead of binding workers to another node's GPUs and GPS shard."""

from __future__ import annotations

import pytest

from pivot_hpc.runtime.world import LayoutError, layout, node_major_problem


def slurm(*nodes: int) -> list[tuple[str | None, str]]:
    return [(str(n), "host") for n in nodes]  # fake nodes of a test cluster share a host


def test_block_distribution_is_node_major() -> None:
    assert node_major_problem(slurm(0, 0, 0, 1, 1, 1), 3) is None
    assert node_major_problem([(None, "a")] * 3 + [(None, "b")] * 3, 3) is None
    # without Slurm, pseudo-nodes on one host (gps.pseudo_node_size)
    assert node_major_problem([(None, "a")] * 6, 3) is None


def test_cyclic_distribution_is_refused_naming_the_ranks() -> None:
    why = node_major_problem(slurm(0, 1, 0, 1, 0, 1), 3)
    assert why == "rank 1 runs on Slurm node 1 but rank 0 of its block on Slurm node 0"
    why = node_major_problem([(None, "a"), (None, "b"), (None, "a"), (None, "b")], 2)
    assert why is not None and "rank 1 runs on b" in why


def test_two_blocks_on_one_slurm_node_are_refused() -> None:
    why = node_major_problem(slurm(0, 0, 0, 0), 2)
    assert why == "ranks 0 and 2 start two blocks on Slurm node 0"


class World:
    """What `layout` asks of COMM_WORLD, for ranks placed at `places` (MPI itself is not
    initialised in test processes; tests/slurm runs the real world)."""

    def __init__(self, rank: int, places) -> None:
        self.rank, self.places = rank, places

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.places)

    def allgather(self, mine):
        return self.places


def test_layout_refuses_in_one_line_with_the_fix(monkeypatch) -> None:
    from pivot_hpc.job.config import load_config

    cfg = load_config(None, ["cluster.nodes=2", "cluster.gpus_per_node=2"])
    with pytest.raises(LayoutError) as err:
        layout(World(0, slurm(0, 1, 0, 1, 0, 1)), cfg)
    msg = str(err.value)
    assert "\n" not in msg and "--distribution=block" in msg and "rank 1" in msg
    lay = layout(World(4, slurm(0, 0, 0, 1, 1, 1)), cfg)
    assert (lay.node, lay.local_rank) == (1, 1)
