"""The scheduler service: sequences, block manager, scheduler, engine loop, tokenizer and
detokenizer, the public gRPC server. Never imports torch."""
from scheduler_service.llm import LLM

__all__ = ["LLM"]
