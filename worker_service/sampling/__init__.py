"""Sampling on the worker: the batch's parameters as tensors (sampling_state), the
batched sampler (sampler) and its fused Triton kernel for plain temperature batches (fused_sampling);
logit_bias, the min_tokens ban and token masks applied before any path (logit_edits, token_masks)."""
import torch

# What fused_sampling.gumbel_sample accepts. Defined here, not there: that module imports Triton,
# so the sampler imports it only when it takes the fused path.
FUSED_SAMPLING_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
