"""The scheduler service: sequences, block manager, scheduler, engine loop, tokenizer and
detokenizer, the public gRPC server. Never imports torch; the offline LLM is in offline/."""
