"""The offline API: scheduler and worker in one process (`from offline import LLM`)."""
from offline.llm import LLM

__all__ = ["LLM"]
