"""Measuring minicb: workloads, per-request and per-step metrics, slot traces, plots, ``minicb bench``."""
