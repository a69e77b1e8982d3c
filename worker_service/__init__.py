"""The worker service: holds the model and its paged KV cache, runs the steps the scheduler sends.

Rooms, top down: api/ > runtime/ > loader/ > models/ > layers/, attention/, sampling/ > parallel/."""
