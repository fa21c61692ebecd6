"""Speculative decoding: proposers (n-gram prompt lookup, a small draft model), the rejection
sampler that keeps the target's output distribution, and the engine-side coordinator."""
