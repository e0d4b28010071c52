"""The engine client: the front end that runs in the gateway's or the offline ``LLM``'s process.
It tokenizes, routes each request to an engine core, detokenizes, applies stop strings and
streams user-facing outputs (``outputs``); ``interface.EngineClientInterface`` is what the
gateway needs of it."""
