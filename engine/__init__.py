"""The engine, split by the process each part runs in:

- ``engine.core``: the pure engine core (requests, scheduler, KV cache manager, block pool,
  block hashes, stop checks, ``EngineCore``); no I/O, no torch, no transport;
- ``engine.actor``: the engine core actor, the thin asyncio shell that feeds the core from the
  bus and sends its steps to the workers (``WorkerLink``);
- ``engine.client``: the front end that runs in the gateway's or ``LLM``'s process: tokenize,
  route, detokenize, stop strings, stream;
- ``engine.structured``: the grammar engine of structured outputs (xgrammar): the engine core
  process's ``GrammarBackend`` (compiling off its loop, matchers, token bitmasks), and the
  checks the client runs on a request's grammar before sending it;
- ``engine.recovery``: the recovery controller, its own actor: a pure retry policy per engine
  core and the shell that sends them ``retry`` over the bus.
"""
