"""Run a simulated coordinator while checking that no generated token is lost or repeated."""

from __future__ import annotations

from pivot_hpc.coordinator.events import SequenceFinished


def run_keeping_tokens(coord) -> dict[tuple[str, int], int]:
    """Run `coord` to the end; every sequence must finish exactly once with exactly its
    target length generated (across aborts, migrations and retractions). Returns
    (role, seq id) -> generated tokens."""
    seen: dict[tuple[str, int], int] = {}
    orig = coord.handle

    def spy(ev):
        if isinstance(ev, SequenceFinished):
            target = ev.result.response_len if ev.role == "rollout" else ev.result.judgement_len
            assert ev.generated == target  # neither lost nor repeated
            assert (ev.role, ev.seq_id) not in seen
            seen[(ev.role, ev.seq_id)] = ev.generated
        orig(ev)

    coord.handle = spy
    coord.run()
    return seen
