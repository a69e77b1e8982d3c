"""Who may call a port: TLS credentials (reloaded when renewed) and bearer tokens (API keys, the worker secret)."""
