"""The GPU scaler: Prometheus queries in, KEDA external-scaler answers out (gRPC)."""
