"""What crosses between layers, at the bottom so every arrow to it points down.

The engine hands the workers a ``SchedulerOutput`` (ids and counts, never tensors) and gets back
``SampledTokens`` per request; the KV-tier moves ride in it as ``TierOps``. The transfer helpers
(``host_to_device`` / ``device_to_host``) are the one way host lists and device tensors cross, for
the engine, the layers and the attention metadata alike. ``SpeculativeConfig`` and the grammar
check are read by the top-level ``config`` and ``sampling_params``. Nothing here imports a
pagedllm package above the top-level modules (``tests/test_layers.py``).
"""
