"""What the scheduler and worker services share, by concern: contract/ (configs, sampling parameters),
net/ (gRPC plumbing), security/ (TLS, bearer tokens), formats/ (model files); the generated stubs and the
Python client."""
from common.contract.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
