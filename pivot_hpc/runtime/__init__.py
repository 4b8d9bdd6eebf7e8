"""The live runtime: one MPI world whose worker ranks shift between roles (docs/design.md §2–§3)."""
