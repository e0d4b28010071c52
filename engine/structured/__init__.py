"""Structured outputs with xgrammar: ``grammars`` builds and checks a request's grammar (in the
client, so a bad schema is a 400, and in the engine core), ``backend`` is the engine core's
``GrammarBackend`` (``engine/core/grammar.py``). xgrammar (and with it torch) is imported on the
first request that uses a grammar, never before."""
