"""Multimodal inputs (images, videos): parsing, hashing and the HF processor (``processor``,
``video``), the engine-side encoder-cache bookkeeping (``encoder_cache``)."""
