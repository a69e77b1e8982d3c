"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step, on Hopper and later.

A decode step is a chain of small kernels (a few microseconds each at one sequence: the skinny
products, rotary and the K/V store, attention); without PDL each one starts only after the previous
has finished and its launch has gone through, a gap of about a microsecond. Launched with PDL, a
kernel's programs may start while the previous kernel's last ones still run, and wait in
`wait_for_previous_kernel` until that kernel has finished and its writes are visible. CUDA graphs
capture the launch attribute, so the replayed steps overlap the same way.

The rule that keeps this exact: a kernel launched with `**pdl_options(device)` calls
`wait_for_previous_kernel()` (under `if PDL:`) before it reads anything an earlier kernel wrote and
before it writes anything, in every program, before any early return. Triton's interpreter (the
CPU tests) has no grid dependency control: there PDL is off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True  # benchmarks switch it off for an A/B in one process, before the first launch


_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


@functools.cache
def _options_on(device: torch.device) -> dict[str, bool]:
    supported = (os.environ.get("TRITON_INTERPRET", "0") != "1"
                 and torch.cuda.get_device_capability(device) >= (9, 0))
    return _ON if supported else _OFF


def pdl_options(device: torch.device) -> dict[str, bool]:
    """The launch options of a PDL-aware kernel on device (its PDL constexpr and Triton's launch_pdl),
    looked up once per device: this runs at every launch. Callers unpack it and never change it."""
    if not ENABLED or device.type != "cuda":
        return _OFF
    return _options_on(device)


@triton.jit
def wait_for_previous_kernel():
    """Waits until the kernel launched before this one has finished (its writes visible), then lets
    the next kernel's programs start: they wait here in turn."""
    gdc_wait()
    gdc_launch_dependents()
