"""Speculative decoding: proposers and the rejection sampler."""
