"""Evaluation: offline task generators, metrics, the sweep runner, its statistics and its report (tables and plots)."""
