"""The public gRPC API: the servicer, conversions, statuses, the tokenizer, request records, reflection;
vllm/: the VllmEngine dialect for gateways."""
