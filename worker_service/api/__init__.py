"""The worker's gRPC server: the Worker servicer, one scheduler session at a time, its statuses."""
