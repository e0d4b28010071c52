"""Secondary tiers behind a CPU tier: what their actors share, the filesystem and object-store
tiers, and the stored chunk's format."""
