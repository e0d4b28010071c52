"""JetStream on NATS: key-value buckets (``kv_bucket``), the object store, event streams
(``nats_stream``), and opening (``create``) or re-replicating (``replicas``) their streams."""
