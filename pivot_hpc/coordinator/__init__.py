"""The coordinator: RL loop, schedulers, planner and shifts over an abstract cluster."""
