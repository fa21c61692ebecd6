"""Multimodal inputs (images): parsing, hashing and the HF processor (``processor``), the
engine-side encoder-cache bookkeeping (``encoder_cache``)."""
