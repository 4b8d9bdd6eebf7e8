"""The `gps:` config section: defaults, overrides, validation messages."""

from __future__ import annotations

import pytest

from pivot_hpc.config import ConfigError
from pivot_hpc.gps import GPSConfig
from pivot_hpc.gps.links import LinkModel
from pivot_hpc.job.config import load_config


def test_gps_section_loads_with_overrides():
    cfg = load_config(
        overrides=["gps.transport=nixl", "gps.group_size=2", 'gps.link_bandwidth_gbps={"1->0": 2}']
    )
    assert cfg.gps.transport == "nixl" and cfg.gps.group_size == 2
    links = LinkModel.from_config(cfg.gps, 3)
    assert links.bandwidth[1, 0] == 2e9 and links.bandwidth[0, 0] == 24e9
    assert links.bandwidth[0, 1] == 12e9 and links.overhead[2, 2] == pytest.approx(5e-6)


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ("gps.transport=tcp", "not a valid choice"),
        ("gps.remote_bandwidth_gbps=0", "bandwidth must be a finite number"),
        ('gps.link_bandwidth_gbps={"a-b": 1}', "node pairs like '1->0'"),
        ("gps.host_budget_gib=-1", "must be >= 0"),
        ("gps.cost_model=fastest", "not a valid choice"),
        ("gps.remote_lanes=0", "gps.remote_lanes.*1..64"),
        ("gps.transfer_timeout_s=0", "gps.transfer_timeout_s.*> 0 seconds"),
    ],
)
def test_bad_gps_values_name_the_key(override, text):
    with pytest.raises(ConfigError, match=text):
        load_config(overrides=[override])


def test_link_override_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match="node outside 0..1"):
        LinkModel.from_config(GPSConfig(link_bandwidth_gbps={"5->0": 1.0}), 2)


def test_importing_the_nixl_transport_leaves_ucx_to_the_site() -> None:
    """UCX_MODULES=^ib would turn InfiniBand off on a cluster: only the launchers of local
    and CPU-only worlds set it (local_world.MPI_ENV, slurm/pivot.sbatch)."""
    import os
    import subprocess
    import sys

    from pivot_hpc.cli.local_world import MPI_ENV

    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    code = "import os, pivot_hpc.gps.transport_nixl; print(os.environ.get('UCX_MODULES'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "None", out.stderr[-2000:]
    assert MPI_ENV["UCX_MODULES"] == "^ib"
