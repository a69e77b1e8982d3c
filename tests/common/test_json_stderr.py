"""--log-format json's stderr, in a process of its own that configures logging as the CLI does and
writes past logging (to fd 2 as native code does, to sys.stderr, an uncaught exception, a line
another process wrote as JSON): every line that comes out is one JSON object, the last ones written
before exit included; a crash's report reaches the real stderr."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

from launch.json_stderr import log_stderr_line
from launch.log_format import JsonFormatter, json_line
from tests.services_harness import REPO_ROOT

PRELUDE = "import os, sys\nfrom launch.log_format import configure_logging\nconfigure_logging('INFO', 'json')\n"


def run_json_process(body: str) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=60)


def test_everything_written_to_stderr_comes_out_as_json_lines_up_to_the_exit() -> None:
    result = run_json_process("""
        import logging
        logging.getLogger("app").info("from logging, line\\u2028separator")
        os.write(2, b"E1201 12:00:00.123456    4242 ssl_transport_security.cc:2563] Handshake failed\\n")
        print("a plain line", file=sys.stderr)
        os.write(2, b'{"level": "INFO", "logger": "child", "message": "next\\xc2\\x85line"}\\n')
        os.write(2, b"W1201 12:00:00.5 7 tcp.cc:1] written last, without a line break")
        raise RuntimeError("uncaught")
    """)
    assert result.returncode == 1
    lines = result.stderr.split("\n")
    assert lines[-1] == ""  # every line ends
    entries = [json.loads(line) for line in lines[:-1]]
    assert all(line.splitlines() == [line] for line in lines[:-1])
    seen = [(e["logger"], e["level"], e["message"]) for e in entries]
    # Logging writes to the real stderr at once, the rest comes through the pipe's reader: each in its order.
    direct = [("app", "INFO", "from logging, line\u2028separator"), ("nanovllm", "CRITICAL", "uncaught exception")]
    piped = [("grpc.core", "ERROR", "Handshake failed"), ("stderr", "WARNING", "a plain line"),
             ("child", "INFO", "next\u0085line"), ("grpc.core", "WARNING", "written last, without a line break")]
    assert sorted(seen) == sorted(direct + piped)
    assert [entry for entry in seen if entry in direct] == direct
    assert [entry for entry in seen if entry in piped] == piped
    by_message = {e["message"]: e for e in entries}
    assert by_message["Handshake failed"]["source"] == "ssl_transport_security.cc:2563"
    assert by_message["uncaught exception"]["exception"].endswith("RuntimeError: uncaught")


def test_a_crash_report_reaches_the_real_stderr() -> None:
    result = run_json_process("""
        import faulthandler
        faulthandler._sigsegv()
    """)
    assert result.returncode < 0
    assert "Fatal Python error: Segmentation fault" in result.stderr


def test_json_lines_escape_what_some_readers_take_for_line_breaks() -> None:
    line = json_line({"request_id": "a\u2028b\u2029c\u0085d\u009fe", "text": "é ü 日本"})
    assert line == '{"request_id": "a\\u2028b\\u2029c\\u0085d\\u009fe", "text": "é ü 日本"}'
    assert json.loads(line)["request_id"] == "a\u2028b\u2029c\u0085d\u009fe"


def test_a_forwarded_json_line_is_written_as_it_was_but_escaped(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    log_stderr_line('{"logger": "worker", "message": "x\u2028y", "n": 1}')
    (record,) = caplog.records
    assert JsonFormatter().format(record) == '{"logger": "worker", "message": "x\\u2028y", "n": 1}'
