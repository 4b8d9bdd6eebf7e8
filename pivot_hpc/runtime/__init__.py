"""The live runtime: one MPI world whose worker ranks shift between roles (DESIGN.md §2–§3)."""
