"""`python -m pivot_hpc` is the same program as the `pivot-hpc` command."""

from __future__ import annotations

from pivot_hpc.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
