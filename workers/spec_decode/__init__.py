"""Speculative decoding in the worker: proposers that draft tokens (``ngram``) and the rejection
sampler that verifies them against the target (``rejection_sampler``)."""
