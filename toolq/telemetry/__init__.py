"""Traces (OpenTelemetry) and metrics (Prometheus) for both ends of a queue: the one layer above
`core` that may open sockets for telemetry, below the workers and the orchestrator that use it.
Off unless turned on: the standard `OTEL_*` variables for traces, `TOOLQ_METRICS_PORT` for metrics."""
