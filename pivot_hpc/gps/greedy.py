"""Load-balancing assignment of demands to senders (App. B.2, step 2).

Demands are walked in order; each goes to the candidate that would finish it earliest:
the accumulated estimated latency it has to wait behind, plus this transfer's cost
(bytes / link bandwidth + per-transfer overhead). A sender on a fast link therefore takes
proportionally more bytes, which pushes the bottleneck sender down. What "waits behind"
means is the cost model:

- MODEL_SENDER (the paper's wording): one accumulated latency per sender.
- MODEL_ENDPOINTS (default): every byte into or out of a GPU crosses that GPU's own host
  link (PCIe; one per GPU), and a remote transfer also waits for the source node's NIC (tx)
  and the destination node's NIC (rx), each shared by the GPUs of its node. This is what
  makes a fully replicated layout read node-locally, as App. B.1 intends ("Full
  replication makes every Read node-local"): with one latency per sender, 15 idle remote
  replicas look faster than the local one and 77% of a 72B, 128-GPU read went remote.

One loop, run as plain Python for small plans (no compilation in short-lived processes)
and compiled by numba for large ones (a 72B model on 128 GPUs has ~10^5 demands); both
do the same float operations in the same order, so every rank computes the same plan.
"""

from __future__ import annotations

import numpy as np

NUMBA_THRESHOLD = 20_000  # candidate evaluations above which the compiled loop is used
MODEL_SENDER = 0
MODEL_ENDPOINTS = 1
MODELS = {"sender": MODEL_SENDER, "endpoints": MODEL_ENDPOINTS}


def assign(
    nbytes: np.ndarray,
    dem_node: np.ndarray,
    dem_gpu: np.ndarray,
    cset: np.ndarray,
    cand_ptr: np.ndarray,
    cand_id: np.ndarray,
    cand_node: np.ndarray,
    bandwidth: np.ndarray,
    overhead: np.ndarray,
    num_senders: int,
    num_gpus: int,
    read: bool,
    model: str = "endpoints",
) -> tuple[np.ndarray, np.ndarray]:
    """Return (chosen candidate id per demand, busy seconds per sender id).

    Read: candidates are holder nodes; demand d goes to GPU dem_gpu[d] on node dem_node[d].
    Write: candidates are GPUs (ids into G) on cand_node; demand d goes to holder node
    dem_node[d]. Candidates of d: cand_id[cand_ptr[cset[d]]:cand_ptr[cset[d]+1]].
    bandwidth/overhead[src_node, dst_node] are bytes/s and seconds, src = data source.
    """
    n_nodes = bandwidth.shape[0]
    i64 = np.int64
    args = (
        np.ascontiguousarray(nbytes, dtype=np.float64),
        np.ascontiguousarray(dem_node, dtype=i64),
        np.ascontiguousarray(dem_gpu, dtype=i64),
        np.ascontiguousarray(cset, dtype=i64),
        np.ascontiguousarray(cand_ptr, dtype=i64),
        np.ascontiguousarray(cand_id, dtype=i64),
        np.ascontiguousarray(cand_node, dtype=i64),
        bool(read),
        MODELS[model],
        np.ascontiguousarray(bandwidth, dtype=np.float64),
        np.ascontiguousarray(overhead, dtype=np.float64),
        np.zeros(num_senders, dtype=np.float64),  # busy time per sender (reported)
        np.zeros(num_senders, dtype=np.float64),  # MODEL_SENDER: accumulated latency
        np.zeros(max(num_gpus, 1), dtype=np.float64),  # per-GPU host link
        np.zeros(n_nodes, dtype=np.float64),  # NIC tx per node
        np.zeros(n_nodes, dtype=np.float64),  # NIC rx per node
    )
    sizes = np.diff(args[4])
    work = int(sizes[args[3]].sum()) if len(args[0]) else 0
    fn = _assign_numba if work > NUMBA_THRESHOLD else _assign_loop
    choice = fn(*args)
    return choice, args[11]


def _assign_loop(
    nbytes, dem_node, dem_gpu, cset, cand_ptr, cand_id, cand_node, read, model,
    bw, ovh, busy, acc, link, tx, rx,
):  # fmt: skip
    choice = np.empty(len(nbytes), dtype=np.int64)
    for d in range(len(nbytes)):
        best = -1
        best_t = np.inf
        best_c = 0.0
        c_set = cset[d]
        for j in range(cand_ptr[c_set], cand_ptr[c_set + 1]):
            s = cand_id[j]
            if read:
                src = cand_node[j]
                dst = dem_node[d]
                gpu = dem_gpu[d]
            else:
                src = cand_node[j]
                dst = dem_node[d]
                gpu = s
            c = nbytes[d] / bw[src, dst] + ovh[src, dst]
            if model == 0:
                start = acc[s]
            elif src == dst:
                start = link[gpu]
            else:
                start = tx[src] if tx[src] > rx[dst] else rx[dst]
                if link[gpu] > start:
                    start = link[gpu]
            t = start + c
            if t < best_t:
                best = s
                best_t = t
                best_c = c
        choice[d] = best
        busy[best] += best_c
        acc[best] = best_t
        if model == 1:
            j0 = cand_ptr[c_set]
            while cand_id[j0] != best:
                j0 += 1
            src = cand_node[j0]
            dst = dem_node[d]
            gpu = dem_gpu[d] if read else best
            link[gpu] = best_t
            if src != dst:
                tx[src] = best_t
                rx[dst] = best_t
    return choice


_compiled = None


def _assign_numba(*args):
    global _compiled
    if _compiled is None:  # numba is imported only when a plan is large enough to need it
        from numba import njit

        _compiled = njit(cache=True)(_assign_loop)
    return _compiled(*args)
