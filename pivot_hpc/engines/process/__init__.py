"""Engines in child processes of their worker rank: spawn, pipe calls, liveness, the
watchdog and the guard that turns a death into an unplanned shift-down."""
