"""Benchmark of the consolidation engine: workload generator, driver and report.

Run ``python -m bench all`` (full targets) or ``python -m bench all --quick``; see bench/README.md.
"""
