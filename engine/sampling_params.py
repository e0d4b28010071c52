"""Sampling parameters for engine users: re-exported from the wire schema, which validates them.

``SamplingParams`` travels client → engine core → worker, so it is defined (with vLLM's names,
defaults and checks) in ``bus.messages.sampling``; this module is where engine code imports it.
"""

from bus.messages.sampling import MAX_LOGPROBS, OutputKind, SamplingParams

__all__ = ["MAX_LOGPROBS", "OutputKind", "SamplingParams"]
