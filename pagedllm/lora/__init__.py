"""Multi-LoRA serving: adapter requests, PEFT checkpoints, device slots paged like KV blocks."""
