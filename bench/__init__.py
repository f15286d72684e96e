"""Benchmarks: scripts that write JSON (and a plot). Speed goals live here, not in timed tests."""
