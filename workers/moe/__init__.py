"""Mixture-of-experts across workers: expert parallelism (``expert_parallel``): which rank owns
which experts, and the all-to-all dispatch/combine of routed tokens between ranks."""
