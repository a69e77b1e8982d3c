"""tests/child_setup.py: the command runs as the process Popen started (same pid, what tests read in
/proc) with the limit set; and no code here passes `preexec_fn` (which forks, see child_setup), except
serve's worker start, which runs before its process starts any gRPC."""
from __future__ import annotations

import ast
import resource
import subprocess
import sys

from tests.child_setup import with_open_file_limit
from tests.services_harness import REPO_ROOT
from tests.test_import_graph import PACKAGES

REPORT = "import os, resource; print(os.getpid(), *resource.getrlimit(resource.RLIMIT_NOFILE))"
FOLDERS = (*PACKAGES, "bench", "tests")
MAY_FORK = {"launch/serve.py"}  # the worker starts before serve runs any gRPC (a comment there says so)


def test_the_command_runs_in_the_started_process_with_the_limits() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted_hard = 2_048 if hard == resource.RLIM_INFINITY else min(hard, 2_048)
    for soft, hard_limit, expected in ((256, None, (256, hard)), (300, wanted_hard, (300, wanted_hard))):
        process = subprocess.Popen(with_open_file_limit([sys.executable, "-c", REPORT], soft, hard_limit),
                                   stdout=subprocess.PIPE, text=True)
        out, _ = process.communicate(timeout=60)
        assert process.returncode == 0
        assert [int(x) for x in out.split()] == [process.pid, *expected]


def preexec_fn_calls(path: str) -> list[int]:
    """Line numbers of calls in the file that pass a preexec_fn keyword."""
    tree = ast.parse((REPO_ROOT / path).read_text(encoding="utf-8"))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and any(keyword.arg == "preexec_fn" for keyword in node.keywords)]


def test_no_code_forks_a_child_through_preexec_fn() -> None:
    files = [str(path.relative_to(REPO_ROOT)) for folder in FOLDERS
             for path in sorted((REPO_ROOT / folder).rglob("*.py"))]
    found = {path: lines for path in files if (lines := preexec_fn_calls(path))}
    assert set(found) == MAY_FORK, found
