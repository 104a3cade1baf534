"""Scheduling and KV-block bookkeeping: pure Python, no torch (a test enforces it).

`Scheduler` decides what runs each step; `KVCacheManager` maps requests to physical KV
blocks through a `BlockPool` with automatic prefix caching by chained block hash.
"""
