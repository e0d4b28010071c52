"""Speculative decoding in the worker: proposers that draft tokens (``ngram``, ``draft_model``,
behind the ``proposer.Proposer`` interface), the verification of drafts with every sampling
option (``verify``) and the rejection sampler under it (``rejection_sampler``)."""
