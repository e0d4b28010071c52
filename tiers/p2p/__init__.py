"""The peer-to-peer tier: finds chunks in other hosts' CPU tiers and pulls them (its actor, the
direct TCP channel, the pulling and the serving sides; its books are
``tiers.books.p2p_sessions``)."""
