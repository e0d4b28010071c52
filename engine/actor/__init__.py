"""The engine core actor (one per data-parallel rank): the asyncio shell that receives requests
from the bus, calls the pure ``EngineCore`` (``engine.core.engine_core``) and sends each step
to its workers (``WorkerLink``). It decides nothing the core should decide."""
