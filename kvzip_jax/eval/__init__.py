"""Evaluation: offline task generators, metrics, the sweep runner and its report (table and plot)."""
