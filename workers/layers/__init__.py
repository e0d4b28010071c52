"""Model building blocks (linear with tensor-parallel shards, embedding, RMSNorm, rotary,
paged attention, MoE) that call ``kernels.ops`` for their math."""
