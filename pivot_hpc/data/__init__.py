"""Prompt datasets: the synthetic arithmetic task and local DAPO/AIME-style files."""

from pivot_hpc.data.problem import LoadReport, Problem

__all__ = ["LoadReport", "Problem"]
