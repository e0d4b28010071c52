"""Operating NATS: launching a local nats-server (``server``), clustering nodes (``cluster``),
least-privilege permissions per actor role, and an actor process's credentials."""
