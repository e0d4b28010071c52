"""The recovery controller: a pure retry policy per engine core (``policy``) in a thin actor
shell (``actor``) that watches the engine cores' heartbeats and status events and sends each
faulted one ``FaultToleranceRequest("retry")``. It commands by message only: nothing of the
engine core, its shell or the client is imported here."""
