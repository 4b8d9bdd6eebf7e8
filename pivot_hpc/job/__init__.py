"""A job as a whole: the config that composes every section, and the one builder that
assembles a ready job from it, live or simulated (docs/design.md §2, §8)."""
