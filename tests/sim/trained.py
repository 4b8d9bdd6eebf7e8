"""Run a simulated coordinator and keep every batch it trains."""

from __future__ import annotations


def run_collecting(coord) -> list:
    """Run `coord` to the end; the batches of samples it trained, in step order."""
    trained = []
    original_end = coord.rl.end_training

    def end_training(step):
        batch = original_end(step)
        trained.append(batch)
        return batch

    coord.rl.end_training = end_training
    coord.run()
    return trained
