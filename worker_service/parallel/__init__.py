"""Tensor parallelism's plumbing: process groups, collectives, and the channel rank 0 passes steps on by."""
