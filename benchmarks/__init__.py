"""Benchmark scripts (run them as files: ``python benchmarks/<name>.py --help``)."""
