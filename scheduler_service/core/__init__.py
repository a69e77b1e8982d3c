"""The scheduler's core, free of gRPC: sequences, blocks, scheduling, the step loop, the detokenizer."""
