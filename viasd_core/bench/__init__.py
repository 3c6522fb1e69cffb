"""Benchmarks: methods side by side, their files, tables and plots."""
