"""The worker service: holds the model and its paged KV cache, runs the steps the scheduler sends.
Its rooms and their floors: README "Layout" (checked by tests/test_import_graph.py's LAYERS)."""
