"""vllm.grpc.engine.VllmEngine, the engine dialect gateways route by (servicer.py is the door)."""
