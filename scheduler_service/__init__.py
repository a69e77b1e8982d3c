"""The CPU-only scheduler service (never imports torch): core/ (sequences, blocks, scheduling, the step
loop), lanes/ (one per worker), observe/ (metrics, load) and api/ (the public gRPC server)."""
