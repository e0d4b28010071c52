"""The gateway: how people and other systems use shoal.

- ``gateway.app.create_app(engine_client, ...)``: the OpenAI-compatible aiohttp app (docs/api.md);
- ``gateway.server.start_http_server(app, host, port)``: serve it;
- ``gateway.nats_api.NatsApi(bus, engine_client, ...)``: the NATS request/reply API
  (docs/nats-api.md);
- ``gateway.metrics.Metrics``: Prometheus metrics with vLLM's names;
- ``gateway.actor.GatewayActor``: all of the above as one actor.
"""
