"""Benchmarks runnable from the installed package (`pagedllm bench ...`); each prints JSON."""
