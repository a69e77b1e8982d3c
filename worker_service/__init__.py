"""The worker service: holds the model and its paged KV cache, and runs the steps the scheduler sends."""
