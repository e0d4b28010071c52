"""Dual-batch overlap (DBO): a step split into micro-batches (ubatches) so one computes while the
other's expert dispatch/combine is on the wire. The pure parts: when to split and how
data-parallel ranks agree on it (``thresholds``), and where the split falls in the batch's tokens,
with each micro-batch's attention metadata (``ubatch_slices``). Execution: the two-thread
ping-pong and the ``dbo_yield`` the MoE all-to-all calls (``ubatching``), and the model forward
over micro-batches (``forward``)."""
