"""Benchmarks: `pagedllm bench throughput | latency | serve`.

Each prints one JSON object on stdout (machine-readable) and a readable summary on stderr.
"""
