"""The actor runtime: the ``Actor`` base (inboxes, heartbeats, drain), the liveness table built
from heartbeats, running one actor as a process (``run_actor``) and supervising many."""
