"""What an operator sees: Prometheus metrics and the load report, fed by the lanes through callbacks."""
