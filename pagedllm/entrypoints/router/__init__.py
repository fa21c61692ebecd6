"""Data parallelism over HTTP: a prefix-aware router in front of OpenAI-compatible replicas.

``pagedllm router --backend URL ...`` fronts servers that already run (on this host or others);
``pagedllm serve MODEL --data-parallel-size N`` starts N ``serve`` replicas on this host, each on
an internal port with its share of the cores, and runs the same router in the parent process.
"""
