"""The worker link's shared secret: where it is read from, how it is checked, and that the
config that carries it never shows it."""
from __future__ import annotations

import pytest

from common.contract.config import WorkerLinkConfig
from common.security.bearer_auth import authorization_of
from common.security.worker_secret import SECRET_ENV, accepts_secret, load_secret, secret_metadata

SECRET = "s3cret-s3cret-s3cret"


def test_secret_from_a_file_wins_over_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123")
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert load_secret(str(path)) == SECRET
    assert load_secret(None) == "from-the-environment-0123"


def test_missing_or_short_secrets_are_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="none given; set NANOVLLM_WORKER_SECRET"):
        load_secret(None)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="holds 5 characters, at least 16"):
        load_secret(None)
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "absent"))


def test_only_the_exact_secret_is_authorized() -> None:
    accepts = accepts_secret(SECRET)
    assert accepts(authorization_of(secret_metadata(SECRET)))
    assert accepts(authorization_of([("authorization", f"Bearer {SECRET}".encode())]))
    for metadata in ((), None, secret_metadata(SECRET + "x"), secret_metadata(SECRET[:-1]),
                     [("authorization", SECRET)], [("x-other", f"Bearer {SECRET}")]):
        assert not accepts(authorization_of(metadata))


def test_the_link_config_never_shows_its_secret() -> None:
    link = WorkerLinkConfig(SECRET, tls_ca="ca.pem")
    assert SECRET not in repr(link) and SECRET not in str(link)
    with pytest.raises(ValueError, match="give both or neither"):
        WorkerLinkConfig(SECRET, tls_cert="cert.pem")
