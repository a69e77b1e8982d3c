"""What the scheduler and worker services share: configs, sampling parameters, generated stubs."""
from common.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
