"""The files models come in: GGUF, checkpoint folders, and where the default model lies."""
