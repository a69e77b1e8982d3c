"""One worker's steps: sequence state, model input, the model runner, KV cache, CUDA graphs, TP ranks."""
