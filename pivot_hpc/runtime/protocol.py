"""Messages between the coordinator (world rank 0) and workers (pickled, two tags).

Coordinator → worker (tag CMD): ("up", role, version), ("down",), ("start", seq_id,
prompt_ids, generated_ids, generated_logprobs), ("abort", seq_id), ("update", version),
("train", step, TrainBatch), ("peek",), ("save", path | None), ("restore", path),
("stop", exit_code).
Worker → coordinator (tag EVT): ("shift", kind, phases), ("finished", [SeqResult]),
("aborted", seq_id, SeqResult | None), ("lengths", {seq_id: length}),
("weights", version), ("trained", step, metrics), ("peeked", role, [SeqResult]),
("saved", rng_states, seconds), ("restored", seconds), ("error", text).
A worker handles commands in order and replies in order, so an "aborted" reply follows
any "finished" report it sent before.
"""

from __future__ import annotations

CMD = 11
EVT = 12
