"""gRPC plumbing both services share: channel and server options, listening ports, exceptions mapped to status codes."""
