"""Library noise a user cannot act on goes to the run's log files, not the console.

megatron-core warns on every rank that Apex and Transformer Engine are missing, torch
about deprecated flags, and so on. Each rank's Python warnings and library log records
(WARNING and above) go to `RUN_DIR/logs/rank-NNNN.log`; what the user acts on (the step
lines, errors, tracebacks) stays on the console.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from pivot_hpc.safe_files import open_for_write


def route_to_log(run_dir: Path, rank: int) -> Path:
    """Send this rank's warnings and library log records to its log file; returns it."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank-{rank:04d}.log"
    stream = open_for_write(path, "a", private=False)  # a planted link is not followed

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    return path
