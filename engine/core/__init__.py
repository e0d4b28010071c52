"""The pure engine core: requests and their queue, the scheduler and its step output, applying
a step's result, the KV cache manager, block pool and block hashes, stop checks and
``EngineCore``. Plain synchronous code with no I/O: it imports only the wire schemas
(``bus.messages``), never a transport, torch, the client or the actor shell."""
