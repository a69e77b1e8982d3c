"""What the services agree on: their configs, sampling parameters, the lookahead rule, the worker's description."""
