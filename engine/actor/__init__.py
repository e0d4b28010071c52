"""The engine core actor (one per data-parallel rank): the asyncio shell that receives requests
from the bus, calls ``engine.core.EngineCore`` and sends each step to its workers
(``WorkerLink``). It decides nothing the core should decide."""
