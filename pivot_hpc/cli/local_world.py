"""The MPI world `pivot-hpc run` starts by itself on a workstation: private, and legible.

*Private network.* The ranks of a one-host world talk through shared memory only (OpenMPI
`btl=self,vader`: no rank opens a TCP listener). mpirun's own control listener (ORTE OOB)
binds every interface in OpenMPI 4 whatever `oob_tcp_if_include` says
(`orte/mca/oob/tcp/oob_tcp_listener.c`, `create_listen`: INADDR_ANY), so where the kernel
allows it the whole world runs in a new network namespace that holds nothing but loopback:
no socket of the job can be reached from another host. Where it does not (a container
without user namespaces), the run goes on in the host's namespace and says so in one line.
`PIVOT_HPC_PRIVATE_NET=0` turns the namespace off.

*Exit status.* A graceful stop returns 3 ("checkpointed, run me again"). Ranks that exit
non-zero make mpirun print an "aborted" box, so under this launcher the ranks report their
status through a file in a private directory and exit 0; the launcher returns it.

*Deaths.* When a rank dies (OOM killer, segfault), mpirun names only its MPI rank; the
launcher reads that line and says which role the rank had and how to resume.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pivot_hpc import interpreter
from pivot_hpc.job.config import Config

# Environment that makes OpenMPI + UCX/NIXL behave on CPU machines (docs/platform.md).
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_osc": "^ucx",  # UCX one-sided reads at ~1 GB/s here; use OpenMPI's own
    "UCX_MODULES": "^ib",  # NIXL's bundled libnl vs Debian's libibverbs segfault at exit
    "OMP_NUM_THREADS": "1",
    # one host: shared memory between ranks, no TCP listener per rank
    "OMPI_MCA_btl": "self,vader",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_disable_ipv6_family": "1",
}
PRIVATE_NET_ENV = "PIVOT_HPC_PRIVATE_NET"
STATUS_DIR_ENV = "PIVOT_HPC_STATUS_DIR"  # where ranks leave their exit status (see above)

# mpirun (OpenMPI 4, help-orterun.txt) when a rank dies by a signal or exits early
_DIED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_EXITED = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")
_NOISE = ("mpirun: Forwarding signal",)  # our own line says what the signal does


def namespace_prefix() -> tuple[list[str], str | None]:
    """The command prefix that starts the world in a private network namespace, and why
    not (None when it can)."""
    if os.environ.get(PRIVATE_NET_ENV, "1") == "0":
        return [], f"{PRIVATE_NET_ENV}=0"
    unshare = shutil.which("unshare")
    if unshare is None:
        return [], "unshare(1) not found (util-linux)"
    cmd = [unshare, "--net"] + (["--map-root-user"] if os.geteuid() != 0 else [])
    loopback_up = interpreter.python("-m", "pivot_hpc.cli.loopback_up")
    probe = subprocess.run(
        [*cmd, *loopback_up, "true"],
        capture_output=True,
        text=True,
        timeout=30,
        env=interpreter.environ(),
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["failed"])[-1]
        return [], f"no private network namespace here ({last})"
    return [*cmd, *loopback_up], None


# Ranks per core a local world may have: the CPU tests run 5+ ranks on 2 cores, and a
# workstation may well oversubscribe; the bound exists to stop a typo, not to tune.
OVERSUBSCRIBE = 8
MIN_LOCAL_RANKS = 64


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """An integer Slurm variable, or None when unset or not a plain number."""
    try:
        value = int(env.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def check_world_fits(
    cfg: Config, env: Mapping[str, str] | None = None, cpus: int | None = None
) -> None:
    """Refuse, in one line and before `mpirun` starts, a world this launcher cannot hold.

    Inside a Slurm allocation (SLURM_JOB_ID set) the world must fit the allocation's
    nodes and tasks; on a workstation, its ranks must stay within a generous
    oversubscription of this machine's cores (see OVERSUBSCRIBE)."""
    from pivot_hpc.errors import ConfigError

    env = os.environ if env is None else env
    c = cfg.cluster
    if "SLURM_JOB_ID" in env:
        nodes = _env_int(env, "SLURM_JOB_NUM_NODES") or _env_int(env, "SLURM_NNODES")
        if nodes is not None and c.nodes > nodes:
            raise ConfigError(
                f"config key 'cluster.nodes' = {c.nodes}: this Slurm allocation (job "
                f"{env['SLURM_JOB_ID']}) has {nodes} node(s); set cluster.nodes <= {nodes} "
                "or allocate more nodes"
            )
        tasks = _env_int(env, "SLURM_NTASKS")
        if tasks is not None and c.world_size > tasks:
            raise ConfigError(
                f"cluster.nodes={c.nodes} x (cluster.gpus_per_node={c.gpus_per_node} + 1 host "
                f"rank) = {c.world_size} ranks, but this Slurm allocation has "
                f"SLURM_NTASKS={tasks}; lower cluster.* or allocate "
                f"--ntasks-per-node={c.ranks_per_node}"
            )
    cores = cpus if cpus is not None else (os.cpu_count() or 1)
    limit = max(MIN_LOCAL_RANKS, OVERSUBSCRIBE * cores)
    per_host = c.ranks_per_node if "SLURM_JOB_ID" in env else c.world_size
    if per_host > limit:
        raise ConfigError(
            f"cluster.nodes={c.nodes} x (cluster.gpus_per_node={c.gpus_per_node} + 1 host "
            f"rank) would start {per_host} ranks on this machine of {cores} cores; the bound "
            f"is {limit} (max({MIN_LOCAL_RANKS}, {OVERSUBSCRIBE} per core)): lower "
            "cluster.gpus_per_node / cluster.nodes"
        )


def role_of_rank(cfg: Config, rank: int) -> str:
    per = cfg.cluster.ranks_per_node
    node, local = divmod(rank, per)
    if rank == 0:
        return "the coordinator (and node 0's parameter-storage host)"
    if local == 0:
        return f"node {node}'s parameter-storage host"
    return f"the worker of GPU {node * cfg.cluster.gpus_per_node + local - 1} (node {node})"


@dataclass
class _Tail:
    """mpirun's stderr, echoed as it comes, the end kept to explain a death."""

    lines: deque[str] = field(default_factory=lambda: deque(maxlen=400))

    def pump(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append(line)
            if not line.startswith(_NOISE):
                sys.stderr.write(line)
                sys.stderr.flush()

    def dead_rank(self) -> tuple[int, int | None] | None:
        """(rank, signal) of the rank mpirun blames, if it names one."""
        text = "".join(self.lines)
        m = _DIED.search(text)
        if m:
            return int(m.group(1)), int(m.group(2))
        m = _EXITED.search(text)
        return (int(m.group(1)), None) if m else None


def launch(cfg: Config, world_argv: list[str], run_dir: Path) -> int:
    """Run `world_argv` as every rank of a local world; returns the job's exit status."""
    from pivot_hpc.errors import PivotError
    from pivot_hpc.runtime.stop import EXIT_REQUEUE, FORWARDED_TERM, SIGNALS

    check_world_fits(cfg)  # run() checked already; a direct caller is held to it too
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise PivotError("mpirun not found: install OpenMPI (apt-get install openmpi-bin)")
    n = cfg.cluster.world_size
    cmd = [mpirun, "-n", str(n), "--oversubscribe", "--bind-to", "none", *world_argv]
    if cfg.cluster.nodes > 1:
        cmd[1:1] = ["--map-by", f"ppr:{cfg.cluster.ranks_per_node}:node"]
    prefix, why_not = namespace_prefix()
    status_dir = Path(tempfile.mkdtemp(prefix="pivot-hpc-status-"))  # mode 700
    # PYTHONSAFEPATH: what the ranks start (engine children's workers, multiprocessing's
    # spawn) leaves the working directory off sys.path too (interpreter.py)
    env = {**interpreter.environ(), **MPI_ENV, STATUS_DIR_ENV: str(status_dir)}
    where = "a private network namespace (loopback only)" if prefix else "the host network"
    print(f"pivot-hpc: launching {n} ranks in {where}: {mpirun} -n {n} …", flush=True)
    if why_not:
        print(
            f"pivot-hpc: note: {why_not}; ranks use shared memory only, but mpirun's "
            "control port listens on every interface (OpenMPI 4)",
            flush=True,
        )
    tail = _Tail()
    received: list[int] = []
    try:
        proc = subprocess.Popen([*prefix, *cmd], env=env, stderr=subprocess.PIPE, text=True)
        pump = threading.Thread(target=tail.pump, args=(proc.stderr,), daemon=True)
        pump.start()

        # mpirun forwards SIGUSR1/SIGUSR2 to every rank but turns SIGTERM into a kill, so a
        # TERM sent to this launcher travels as USR2 (the ranks record it as SIGTERM).
        def forward(signum, _frame) -> None:
            received.append(signum)
            proc.send_signal(FORWARDED_TERM if signum == signal.SIGTERM else signal.SIGUSR1)

        for sig in SIGNALS:
            signal.signal(sig, forward)
        code = proc.wait()
        pump.join(timeout=5)
        reported = [int(p.read_text() or 0) for p in status_dir.glob("rank-*")]
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    if code == 0 and reported:
        code = max(reported)
    if code == EXIT_REQUEUE:
        print("pivot-hpc: checkpointed and stopped; resume with the same command", flush=True)
    elif code not in (0, 2) and not received:
        print(f"pivot-hpc: error: {_death_line(cfg, tail, code, run_dir)}", file=sys.stderr)
    return code


def _death_line(cfg: Config, tail: _Tail, code: int, run_dir: Path) -> str:
    from pivot_hpc.checkpoint import store

    who = tail.dead_rank()
    if who is None:
        what = f"the MPI world failed (mpirun exit status {code})"
    else:
        rank, sig = who
        how = f"was killed by {signal.Signals(sig).name}" if sig else "exited early"
        hint = " (often the out-of-memory killer)" if sig == signal.SIGKILL else ""
        what = f"rank {rank}, {role_of_rank(cfg, rank)}, {how}{hint}, which stopped the job"
    try:
        newest = store.newest(run_dir)
        step = store.verify(newest)["step"] if newest is not None else None
    except Exception:  # a damaged checkpoint is reported by the next run, by name
        newest, step = None, None
    again = (
        f"running the same command resumes from checkpoint {newest.name} (step {step})"
        if newest is not None
        else "no checkpoint was written yet: running the same command starts over"
    )
    return f"{what}; {again}"


def report_status(code: int) -> int:
    """In a world this launcher started: leave `code` for it and exit 0 (see above)."""
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if not status_dir or code == 0:
        return code
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", str(os.getpid()))
    try:
        Path(status_dir, f"rank-{rank}").write_text(str(code))
    except OSError:
        return code  # the launcher is gone: say it the plain way
    return 0
