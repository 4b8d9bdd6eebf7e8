"""GlobalParameterStorage: the host-memory copy of every model, with Read and Write.

Versioning (double buffer + seqlock). A writable model has two slots per node. Each
node's header holds the published version and a stamp per slot (the version the slot
holds, -1 while it is rewritten); the slot of version v is the one stamped v, the same
on every node. Write of w (slot t = the slot NOT stamped with the published version v,
whatever the parity of w: `write(version=...)` may skip versions): the leader sets
stamp[t] = -1 on every node; barrier; every writer fills slot t on every holder;
barrier; the leader sets stamp[t] = w on every node, then published = w on every node.
A Read takes v from its own node's header and its slot from the stamps, copies that
slot from the holders of its plan, then re-reads those holders' stamps: if any is no
longer v (a second Write has started recycling that slot), it retries with the new
version. So a Read returns exactly one version, never blocks a Write, and is never
blocked by one (a Read fails only if it outlasts gps.read_retries Writes). Memory cost:
2x the model's bytes per node for writable models, 1x for read-only ones (GenRM).

Memory ordering (MPI-3 unified model, seqlock): the shared window stays in a
passive-target epoch (Lock_all) for its lifetime so that Win.Sync, a memory barrier in
the shared-memory component, is legal everywhere. Writers: stamp -1, Sync, barrier,
Sync, data, Sync, barrier, Sync, stamp, Sync, published, Sync. Readers: published, Sync,
stamps, Sync, data, Sync, stamps again. Stamps never return to an old version, so a
re-check that still sees v proves no byte of the copy came from another version.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from mpi4py import MPI

from pivot_hpc.errors import PivotError
from pivot_hpc.gps.catalog import GPSError, ModelSpec, Parallelism
from pivot_hpc.gps.config import GPSConfig
from pivot_hpc.gps.layout import GIB, HostLayout, choose_group_size
from pivot_hpc.gps.links import LinkModel
from pivot_hpc.gps.nodes import split_nodes
from pivot_hpc.gps.pinned import DirectLocalCopy
from pivot_hpc.gps.plan import Plan, PlanCache, build_read_plan, build_write_plan, check_request
from pivot_hpc.gps.transport import Arena, Batch
from pivot_hpc.gps.transport_nixl import NixlTransport, nixl_available
from pivot_hpc.gps.transport_rma import RmaTransport

PUBLISHED, STAMP0 = 0, 1  # int64 positions in a model's header


def _cuda_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def default_budget_bytes(nodes_per_host: int) -> int:
    """Half of this machine's RAM, shared among the pseudo-nodes on it."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * 0.5 / max(1, nodes_per_host))


class GlobalParameterStorage:
    """See the package docstring (pivot_hpc.gps) for who calls what."""

    def __init__(
        self,
        comm: MPI.Comm,
        config: GPSConfig | None = None,
        models: Mapping[str, ModelSpec] | None = None,
        read_only: Iterable[str] = (),
    ) -> None:
        cfg = config or GPSConfig()
        cfg.validate("gps")
        if not models:
            raise GPSError("GlobalParameterStorage needs models={name: ModelSpec, ...}")
        unknown = set(read_only) - set(models)
        if unknown:
            raise GPSError(f"read_only names {sorted(unknown)} are not models {sorted(models)}")
        self.cfg = cfg
        self.models = dict(models)
        self.nodes = nodes = split_nodes(comm, cfg.pseudo_node_size)
        self.world = comm
        writable = set(models) - set(read_only)
        if cfg.host_budget_gib > 0:
            budget = int(cfg.host_budget_gib * GIB)
        else:
            budget = comm.allreduce(default_budget_bytes(nodes.nodes_per_host), op=MPI.MIN)
        self.budget_bytes = budget
        k = choose_group_size(models, writable, nodes.num_nodes, budget, cfg.group_size)
        self.layout = layout = HostLayout(models, writable, nodes.num_nodes, k)
        self.member = layout.member_of(nodes.node)
        size = int(layout.node_bytes[self.member]) if nodes.is_host else 0
        self._shwin = MPI.Win.Allocate_shared(size, 1, comm=nodes.local)
        # one passive-target epoch for the window's lifetime: MPI-3 allows Win.Sync (the
        # barrier every header/data access below relies on) only inside an epoch, and
        # MPICH enforces it; NOCHECK: nobody ever locks this window exclusively
        self._shwin.Lock_all(MPI.MODE_NOCHECK)
        mem, _ = self._shwin.Shared_query(0)
        self.buf = np.frombuffer(mem, dtype=np.uint8)
        if nodes.is_host:
            for name in models:
                self._header(name)[:] = -1  # nothing published, both slots empty
        self._sync_barrier(nodes.local)
        # every rank of a node exposes the node's buffer (its own mapping of the same
        # pages): remote lanes then read one node through several processes (transport_rma)
        self._win = MPI.Win.Create(self.buf, 1, comm=comm)
        self.links = LinkModel.from_config(cfg, nodes.num_nodes)
        self.plans = PlanCache()
        # node-local copies; Reads into VRAM go straight out of the window, page-locked
        # for CUDA on first use (pinned.py)
        self.local = DirectLocalCopy(self.buf)
        max_bytes = cfg.max_transfer_mib << 20
        choice = cfg.transport
        if choice == "auto":
            choice = "nixl" if _cuda_present() and nixl_available() else "rma"
        self.transport_name = choice
        if choice == "nixl":
            self.remote: Any = NixlTransport(
                nodes,
                self.buf,
                max_bytes,
                lanes=cfg.remote_lanes,
                progress_thread=cfg.nixl_progress_thread,
                timeout_s=cfg.transfer_timeout_s,
            )
        else:
            self.remote = RmaTransport(self._win, nodes.ranks_of(), max_bytes, cfg.remote_lanes)
        self._groups: dict[tuple[int, ...], MPI.Comm] = {}
        self.read_retries = 0  # Reads repeated because a Write recycled their slot
        comm.Barrier()

    # ---- header (version) access -------------------------------------------------------
    def _header(self, model: str) -> np.ndarray:
        off = self.layout.header_offset(model)
        return np.ndarray((3,), dtype=np.int64, buffer=self.buf, offset=off)

    def _get_header(self, node: int, model: str) -> np.ndarray:
        if node == self.nodes.node:
            return self._header(model).copy()
        out = np.empty(3, dtype=np.int64)
        target = int(self.nodes.host_of[node])
        self._win.Lock(target, MPI.LOCK_SHARED)
        self._win.Get([out, MPI.BYTE], target, (self.layout.header_offset(model), 24, MPI.BYTE))
        self._win.Unlock(target)
        return out

    def _set_header(self, node: int, model: str, pos: int, value: int) -> None:
        if node == self.nodes.node:
            self._shwin.Sync()  # earlier stores (data, stamps) land before this one
            self._header(model)[pos] = value
            self._shwin.Sync()
            return
        val = np.array([value], dtype=np.int64)
        target = int(self.nodes.host_of[node])
        self._win.Lock(target, MPI.LOCK_EXCLUSIVE)
        disp = self.layout.header_offset(model) + 8 * pos
        self._win.Put([val, MPI.BYTE], target, (disp, 8, MPI.BYTE))
        self._win.Unlock(target)

    def _slot_holding(self, model: str, h: np.ndarray, version: int) -> int:
        """The slot stamped with `version` in header `h`, or -1 (none: being rewritten).

        Stamps, not the parity of `version`, say where a version lives: a Write goes to
        the slot not holding the published version, and `write(version=...)` may skip
        versions, so parity alone would point at the slot a Write is recycling."""
        if version < 0:
            return -1
        for s in range(self.layout.slots(model)):
            if int(h[STAMP0 + s]) == version:
                return s
        return -1

    def _published(self, model: str) -> tuple[int, int]:
        """(published version, its slot or -1) from this node's header, in seqlock order:
        the writer stores the stamp before `published`, so read `published` first; a Read
        then copies the slot and re-checks its stamp (`read`)."""
        h = self._header(model)
        self._shwin.Sync()  # see the latest stores of writers on this node
        version = int(h[PUBLISHED])
        self._shwin.Sync()  # the stamp loads below must not move above the version load
        stamps = h.copy()
        self._shwin.Sync()  # nor the caller's data loads above the stamp loads
        return version, self._slot_holding(model, stamps, version)

    def _free_slot(self, model: str) -> int:
        """The slot a Write or load fills: never the one readers of the published version
        are copying (the header is only ever changed by the one writer, who calls this)."""
        if self.layout.slots(model) < 2:
            return 0
        _, held = self._published(model)
        return 0 if held < 0 else 1 - held

    def _sync_barrier(self, comm: MPI.Comm) -> None:
        """Stores before it are visible to loads after it on every rank of `comm` (the
        unified-model recipe for shared windows: Sync; process sync; Sync)."""
        self._shwin.Sync()
        comm.Barrier()
        self._shwin.Sync()

    def version(self, model: str) -> int:
        """The published version of `model` as this node sees it (-1: never loaded)."""
        self._spec(model)
        self._shwin.Sync()  # the reader's half of Sync; barrier (or message); Sync
        return int(self._header(model)[PUBLISHED])

    # ---- public operations ----------------------------------------------------------------
    def load(
        self,
        model: str,
        tensors: Mapping[str, np.ndarray] | Callable[[str], np.ndarray],
        version: int = 0,
    ) -> None:
        """Fill every node from full canonical tensors (e.g. a checkpoint) and publish.

        Collective over the world; only host ranks touch `tensors` (a mapping or a callable
        name -> full array), so other ranks may pass {}.
        """
        spec = self._spec(model)
        err = ""
        try:
            self._load_local(model, spec, tensors, version)
        except (GPSError, PivotError) as exc:  # PivotError: a bad model directory
            err = str(exc)
        errors = self.world.allgather(err)  # a bad tensor fails every rank, none hangs
        if any(errors):
            raise GPSError(f"load of {model!r} failed: {next(e for e in errors if e)}")

    def _load_local(self, model, spec, tensors, version) -> None:
        lay = self.layout
        if self.nodes.is_host:
            # every host sees the same header (same history), so all pick the same slot;
            # like a Write: the slot not being read, marked in progress before its bytes
            # change (a load that fails half-way leaves the published version readable)
            slot = self._free_slot(model)
            h = self._header(model)
            h[STAMP0 + slot] = -1
            self._shwin.Sync()
            get = tensors if callable(tensors) else tensors.__getitem__
            bounds, offs = lay.bounds[model][:, self.member], lay.offsets[model][self.member, slot]
            ends = lay.bounds[model][:, self.member + 1]
            for ti, t in enumerate(spec.tensors):
                full = _as_bytes(get(t.name), t, f"load({model!r})")
                row = t.cols * t.itemsize
                blk = full[bounds[ti] * row : ends[ti] * row]
                self.buf[offs[ti] : offs[ti] + blk.size] = blk
            self._shwin.Sync()
            h[STAMP0 + slot] = version
            if lay.slots(model) == 2:
                # the other slot's version is being replaced (possibly by an older one, a
                # checkpoint): only the loaded slot may carry a stamp readers accept
                h[STAMP0 + 1 - slot] = -1
            self._shwin.Sync()
            h[PUBLISHED] = version
            self._shwin.Sync()

    def make_arena(
        self, model: str, ranks: Iterable[int], parallelism: Parallelism, device: str | None = None
    ) -> Arena:
        """A reusable destination for repeated Reads of the same (M, G, P) by this rank."""
        plan, i = self._read_plan(model, ranks, parallelism)
        return Arena(plan.shards[i].arena_bytes, device)

    def read(
        self,
        model: str,
        ranks: Iterable[int],
        parallelism: Parallelism,
        *,
        device: str | None = None,
        arena: Arena | None = None,
    ) -> tuple[dict[str, Any], int]:
        """Read(M, G, P) on one rank of G: (this rank's shards by HF name, version read).

        Called by each rank of G, independently (no collective, the hosts do nothing).
        Returns numpy arrays (bfloat16 as uint16 bit patterns) when `device` is None,
        torch tensors on `device` otherwise. With `arena` the shards are views into it.
        On a CUDA device the node-local bytes are DMA'd from the page-locked window
        straight into the arena (see `pin_host_memory`); pass a reused arena (`make_arena`)
        to keep the VRAM allocation out of the timed path.
        """
        plan, i = self._read_plan(model, ranks, parallelism)
        sh = plan.shards[i]
        if arena is None:
            arena = Arena(sh.arena_bytes, device)
        elif arena.nbytes != sh.arena_bytes:
            raise GPSError(f"arena of {arena.nbytes} B does not fit this read ({sh.arena_bytes} B)")
        elif device is None and arena.torch is not None:
            device = arena.device  # a torch arena (make_arena(device=...)) yields its tensors
        version = -1
        try:
            for _ in range(self.cfg.read_retries):
                version, slot = self._published(model)
                if version < 0:
                    raise GPSError(f"model {model!r} has no version yet: load() or write() it")
                if slot < 0:  # a later Write already recycles its slot: take the newer one
                    self.read_retries += 1
                    continue
                batches = self._batches(plan, i, slot)
                for node, batch in batches:
                    tr = self.local if node == self.nodes.node else self.remote
                    tr.get(node, arena, batch)
                self._shwin.Sync()  # the copy's loads complete before the stamps are re-read
                stale = [
                    n for n, _ in batches if self._get_header(n, model)[STAMP0 + slot] != version
                ]
                if not stale:
                    break
                self.read_retries += 1
            else:
                raise GPSError(
                    f"read of {model!r}: the slot was recycled by writes {self.cfg.read_retries} "
                    "times in a row (gps.read_retries); writes are too frequent for this read"
                )
        finally:
            getattr(self.remote, "release", lambda a: None)(arena)
        return _views(self.models[model], sh, arena, device), version

    def write(
        self,
        model: str,
        ranks: Iterable[int],
        parallelism: Parallelism,
        tensors: Mapping[str, Any],
        *,
        version: int | None = None,
    ) -> int:
        """Write(M, G, P): collective over the ranks of G; publishes and returns v+1, or
        `version` when given (it must be newer than the published one: a model that is
        written only now and then, like the optimizer state elastic training reads, keeps
        the version of the policy it belongs to).

        `tensors` holds this rank's shards (HF names, shard shapes) of every tensor its
        pipeline stage holds, as numpy arrays (bfloat16 as uint16) or torch tensors (GPU
        tensors are staged through one host buffer). Bad input fails on every rank of G
        before any byte moves. One Write per model at a time (the trainer's).
        """
        spec = self._spec(model)
        if self.layout.slots(model) < 2:
            raise GPSError(f"model {model!r} is read-only in this GPS (read_only=...); not written")
        g = check_request(model, spec, ranks, parallelism, self.world.size)
        i = self._index_in(g)
        plan = self.plans.get(
            ("write", model, g, parallelism),
            lambda: build_write_plan(
                model, spec, self.layout, self.nodes.node_of, g, parallelism, self.links
            ),
        )
        comm = self._group(g)
        sh = plan.shards[i]
        try:
            arena, err = _stage(spec, sh, tensors, model), ""
        except GPSError as exc:
            arena, err = None, str(exc)
        errors = comm.allgather(err)  # every writer learns of any bad input before a transfer
        if any(errors):
            bad = {g[j]: e for j, e in enumerate(errors) if e}
            raise GPSError(f"write of {model!r} aborted before any transfer: {bad}")
        assert arena is not None
        leader = i == 0
        # the leader's node header decides for every node (the leader writes all of them
        # identically); the slot comes from where the published version is, not from the
        # new version's parity, which `version=` can keep equal to the published one's
        current, slot = comm.bcast(
            (self.version(model), self._free_slot(model)) if leader else None, root=0
        )
        new = current + 1 if version is None else int(version)
        if new <= current:
            raise GPSError(
                f"write of {model!r} at version {new}: version {current} is already published"
            )
        nodes = range(self.nodes.num_nodes)
        if leader:
            for n in nodes:
                self._set_header(n, model, STAMP0 + slot, -1)
        self._sync_barrier(comm)  # no writer touches slot t before it is marked -1
        try:
            for node, batch in self._batches(plan, i, slot):
                tr = self.local if node == self.nodes.node else self.remote
                tr.put(node, arena, batch)
        finally:
            getattr(self.remote, "release", lambda a: None)(arena)
        self._sync_barrier(comm)  # every writer's bytes land before the stamp
        if leader:
            for n in nodes:
                self._set_header(n, model, STAMP0 + slot, new)
            for n in nodes:
                self._set_header(n, model, PUBLISHED, new)
        comm.Barrier()
        return new

    def pin_host_memory(self) -> bool:
        """Page-lock this node's window for CUDA DMA in this process now (otherwise the
        first Read into VRAM does it). Needs a CUDA device; returns whether it worked
        (if not, `self.local.registration.error` says why and Reads use staged copies)."""
        return self.local.pin().ok

    def host_shard(self, model: str, name: str, version: int | None = None) -> np.ndarray:
        """This node's member block of one tensor (host-side view; for checks and tests)."""
        spec = self._spec(model)
        if version is None:
            v, slot = self._published(model)
        else:
            v, slot = version, self._slot_holding(model, self._header(model).copy(), version)
        if slot < 0:
            raise GPSError(f"{model!r}: no slot of node {self.nodes.node} holds version {v}")
        ti = spec.index[name]
        t = spec.tensors[ti]
        lay = self.layout
        b = lay.bounds[model][ti]
        rows = int(b[self.member + 1] - b[self.member])
        off = int(lay.offsets[model][self.member, slot, ti])
        nbytes = rows * t.cols * t.itemsize
        return self.buf[off : off + nbytes]

    def close(self) -> None:
        """Collective over the world: release transports and windows."""
        self.world.Barrier()
        self.local.close()  # unpin before the window's memory goes away
        self.remote.close()
        for g in sorted(self._groups):  # same order on every member
            self._groups[g].Free()
        self._groups.clear()
        self._win.Free()
        self._shwin.Unlock_all()  # end the lifetime epoch (__init__): Free needs none open
        self._shwin.Free()

    # ---- helpers -------------------------------------------------------------------------
    def _spec(self, model: str) -> ModelSpec:
        spec = self.models.get(model)
        if spec is None:
            raise GPSError(f"unknown model {model!r}; this GPS holds {sorted(self.models)}")
        return spec

    def _index_in(self, g: tuple[int, ...]) -> int:
        me = self.world.rank
        if me not in g:
            raise GPSError(f"world rank {me} is not in G = {list(g)}; only ranks of G call this")
        return g.index(me)

    def _read_plan(self, model: str, ranks, par: Parallelism) -> tuple[Plan, int]:
        spec = self._spec(model)
        g = check_request(model, spec, ranks, par, self.world.size)
        i = self._index_in(g)
        plan = self.plans.get(
            ("read", model, g, par),
            lambda: build_read_plan(
                model, spec, self.layout, self.nodes.node_of, g, par, self.links
            ),
        )
        return plan, i

    def _batches(self, plan: Plan, i: int, slot: int) -> list[tuple[int, Batch]]:
        """This actor's ops grouped per host node, with absolute offsets for `slot`."""
        key = ("batches", i, slot)
        cached = plan.cache.get(key)
        if cached is not None:
            return cached
        ops = plan.ops(i)
        sh = plan.shards[i]
        ntensors = len(self.models[plan.model].tensors)
        shard_base = np.zeros(ntensors, dtype=np.int64)
        shard_base[sh.tensors] = sh.offsets
        t, m = plan.op_tensor[ops], plan.op_member[ops]
        host = self.layout.offsets[plan.model][m, slot, t] + plan.op_host_off[ops]
        arena = shard_base[t] + plan.op_shard_off[ops]
        node = plan.op_node[ops]
        out = []
        for n in np.unique(node).tolist():
            sel = node == n
            out.append(
                (
                    n,
                    Batch(
                        host[sel],
                        plan.op_nrows[ops][sel],
                        plan.op_row_bytes[ops][sel],
                        plan.op_stride[ops][sel],
                        arena[sel],
                    ),
                )
            )
        # own node first: its copies need no network and overlap nothing anyway
        out.sort(key=lambda nb: nb[0] != self.nodes.node)
        plan.cache[key] = out
        return out

    def _group(self, g: tuple[int, ...]) -> MPI.Comm:
        comm = self._groups.get(g)
        if comm is None:
            group = self.world.Get_group().Incl(list(g))
            comm = self._groups[g] = self.world.Create_group(group, tag=7)
            group.Free()
        return comm


def _as_bytes(arr: Any, t, where: str) -> np.ndarray:
    """Flat uint8 bytes of a full tensor, checking shape and element size."""
    a = _to_numpy(arr)
    if tuple(a.shape) != tuple(t.shape) or a.itemsize != t.itemsize:
        raise GPSError(
            f"{where}: tensor {t.name!r} is {tuple(a.shape)} with {a.itemsize}-byte elements; "
            f"expected {t.shape} of {t.dtype}"
        )
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _to_numpy(arr: Any) -> np.ndarray:
    if isinstance(arr, np.ndarray):
        return arr
    if hasattr(arr, "detach"):  # torch tensor (bfloat16 has no numpy dtype: view as uint16)
        import torch

        t = arr.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
        return t.numpy()
    return np.asarray(arr)


def _stage(spec: ModelSpec, sh, tensors: Mapping[str, Any], model: str) -> Arena:
    """Check a writer's shards and pack them into one arena (one registration, one view)."""
    missing = [n for n in sh.names if n not in tensors]
    if missing:
        raise GPSError(
            f"write of {model!r}: this rank's stage needs {len(sh.names)} tensors; missing "
            f"{missing[:4]}{' ...' if len(missing) > 4 else ''}"
        )
    arena = Arena(sh.arena_bytes)
    assert arena.host is not None
    for p, name in enumerate(sh.names):
        a = _to_numpy(tensors[name])
        t = spec.tensors[sh.tensors[p]]
        if tuple(a.shape) != tuple(sh.shapes[p]) or a.itemsize != t.itemsize:
            raise GPSError(
                f"write of {model!r}: shard {name!r} is {tuple(a.shape)} with {a.itemsize}-byte "
                f"elements; this rank's shard is {sh.shapes[p]} of {t.dtype}"
            )
        off = int(sh.offsets[p])
        arena.host[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return arena


def _views(spec: ModelSpec, sh, arena: Arena, device: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p, name in enumerate(sh.names):
        off, n = int(sh.offsets[p]), int(sh.nbytes[p])
        t = spec.tensors[sh.tensors[p]]
        if device is None:
            assert arena.host is not None
            out[name] = arena.host[off : off + n].view(sh.dtypes[p]).reshape(sh.shapes[p])
        else:
            import torch

            raw = arena.torch if arena.torch is not None else torch.from_numpy(arena.host)
            dt = getattr(torch, t.dtype)
            out[name] = raw[off : off + n].view(dt).view(sh.shapes[p])
    return out
