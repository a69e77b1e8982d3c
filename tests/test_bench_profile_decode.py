"""bench/profile_decode's idle accounting, on a hand-made kernel timeline (the script itself needs a GPU):
the idle time between kernels, by the pair of kernels around each gap, with overlapping kernels (PDL)
counting as one busy span."""
from __future__ import annotations

from types import SimpleNamespace

from torch.autograd import DeviceType

from bench.profile_decode import kernel_spans, print_idle_by_boundary, print_idle_timeline


def kernel(start: float, end: float, name: str, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device, name=name)


def test_idle_time_is_summed_by_the_kernels_around_each_gap(capsys) -> None:
    timeline = [kernel(0, 10, "norm"), kernel(12, 20, "gemm"), kernel(15, 30, "rope"), kernel(31, 40, "norm"),
                kernel(45, 50, "gemm"), kernel(50, 60, "norm"), kernel(70, 80, "gemm"),
                kernel(0, 100, "host op", DeviceType.CPU)]
    print_idle_by_boundary(kernel_spans(timeline), 5)
    lines = capsys.readouterr().out.splitlines()
    # norm -> gemm: gaps of 2, 5 and 10 us; rope (overlapping gemm, ending last) -> norm: 1 us; none after
    # the back-to-back gemm -> norm at 50; the CPU event is not a kernel.
    assert [line.split() for line in lines[1:]] == [["0.0", "3", "5.7", "norm", "->", "gemm"],
                                                   ["0.0", "1", "1.0", "rope", "->", "norm"]]


def test_idle_timeline_puts_each_gap_in_the_slice_it_ends_in(capsys) -> None:
    timeline = [kernel(0, 10, "norm"), kernel(12, 20, "gemm"), kernel(15, 30, "rope"), kernel(31, 40, "norm")]
    print_idle_timeline(kernel_spans(timeline), 2)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    # Slices of 20 us: the 2 us gap before gemm and rope's overlapping start in the first, the 1 us gap
    # before the last norm in the second.
    assert [(row[2], row[3]) for row in rows] == [("10%", "2"), ("5%", "1")]
