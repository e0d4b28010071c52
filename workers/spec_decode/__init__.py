"""Speculative decoding in the worker: proposers that draft tokens for the target to verify."""
