"""Observing: the runtime's counters (`stats`), their Prometheus form (`metrics`) and the bounded
HTTP server that exports them (`metrics_server`)."""
