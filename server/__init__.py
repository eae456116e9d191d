"""The per-rank async gRPC server."""
