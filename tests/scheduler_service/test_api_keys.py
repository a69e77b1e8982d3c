"""ApiKeys: keys from a file and the NANOVLLM_API_KEYS variable, `Bearer` only, every key accepted."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.security.api_keys import API_KEYS_ENV, ApiKeys
from tests.services_harness import run_cli


def test_keys_from_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# comment\n  file-key-1  \n\nfile-key-2\n")
    keys = ApiKeys.from_config(str(path), environ={API_KEYS_ENV: "env-key-1, env-key-2,"})
    assert keys is not None
    for key in ("file-key-1", "file-key-2", "env-key-1", "env-key-2"):
        assert keys.accepts(f"Bearer {key}") and keys.accepts(f"bearer {key}")
    for authorization in (None, "", "Bearer", "Bearer ", "file-key-1", "Basic file-key-1", "Bearer file-key",
                          "Bearer # comment", "Bearer file-key-1x"):
        assert not keys.accepts(authorization), authorization


def test_no_configuration_means_no_keys() -> None:
    assert ApiKeys.from_config(None, environ={}) is None
    assert ApiKeys.from_config(None, environ={API_KEYS_ENV: ""}) is None


@pytest.mark.parametrize("content", ["", "# only a comment\n\n"])
def test_a_key_file_without_keys_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match="api_key_file: holds no key"):
        ApiKeys.from_config(str(path), environ={})


def test_the_scheduler_refuses_a_missing_key_file(tmp_path: Path) -> None:
    result = run_cli("--log-level", "WARNING", "scheduler", "--worker", "127.0.0.1:1", "--api-key-file",
                     str(tmp_path / "absent.txt"), timeout=60)
    assert result.returncode == 2
    absent = tmp_path / "absent.txt"
    assert result.stderr == f"nanovllm scheduler: api_key_file: cannot read {absent}: FileNotFoundError\n"
