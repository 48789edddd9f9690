"""Benchmarks, demo helpers and emulated remote origins."""
