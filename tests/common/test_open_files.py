"""The open-file limit a service starts with: the soft limit raised to the hard one, and a warning
when the hard one is too low for thousands of connections."""
from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from common.net.open_files import LOW_OPEN_FILE_LIMIT
from tests.child_setup import with_open_file_limit
from tests.services_harness import REPO_ROOT

REPORT = ("import logging, resource; logging.basicConfig(level='WARNING', format='%(levelname)s %(message)s'); "
          "from common.net.open_files import raise_open_file_limit; "
          "print(raise_open_file_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))")


def raised_from(soft: int, hard: int) -> subprocess.CompletedProcess:
    """raise_open_file_limit() in a fresh process started with these limits (lowering them needs no
    privilege): its return value and the limits after, on stdout."""
    return subprocess.run(with_open_file_limit([sys.executable, "-c", REPORT], soft, hard), capture_output=True,
                          text=True, cwd=REPO_ROOT, timeout=60, check=True)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < LOW_OPEN_FILE_LIMIT:
        pytest.skip(f"this machine's hard open-file limit is {hard}")
    wanted = LOW_OPEN_FILE_LIMIT if hard == resource.RLIM_INFINITY else hard
    result = raised_from(1_024, wanted)
    assert result.stdout.split() == [str(wanted)] * 3
    assert result.stderr == ""


def test_a_low_hard_limit_is_used_and_warned_about() -> None:
    result = raised_from(512, 4_096)
    assert result.stdout.split() == ["4096"] * 3
    assert result.stderr.startswith("WARNING the open-file limit is 4096 (hard)")
    assert "ulimit -Hn" in result.stderr
