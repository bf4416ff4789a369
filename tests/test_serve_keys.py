"""serve's access keys: flags, key files and environment variables together, weak or exposed keys
said out loud."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_serve import options

from pdserve.router.auth import AccessKeys
from pdserve.serve_keys import access_keys, warn_if_exposed


def test_keys_come_from_flags_files_and_the_environment_and_exposure_is_said_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("file-key-0123456789abcdef\n")
    keys.chmod(0o644)
    o = options(
        "--model",
        "m",
        "--colocated",
        "1",
        "--api-key",
        "flag-key-0123456789abcd",
        "--api-key-file",
        str(keys),
    )
    with caplog.at_level("WARNING", logger="pdserve.serve"):
        found = access_keys(
            o, {"PDSERVE_API_KEY": "env-1-0123456789abcdef, short", "PDSERVE_METRICS_KEY": "m" * 20}
        )
    assert found.api == (
        "flag-key-0123456789abcd",
        "file-key-0123456789abcdef",
        "env-1-0123456789abcdef",
        "short",
    )
    assert found.metrics == ("m" * 20,) and found.admin == ()
    assert "readable by other users" in caplog.text and "only 5 characters" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="pdserve.serve"):
        warn_if_exposed("127.0.0.1", AccessKeys())
        warn_if_exposed("::1", AccessKeys())
        assert caplog.text == ""
        warn_if_exposed("0.0.0.0", AccessKeys())
        assert "SERVING ON 0.0.0.0 WITHOUT AN API KEY" in caplog.text
        caplog.clear()
        warn_if_exposed("0.0.0.0", found)
        assert "WITHOUT" not in caplog.text and "admin API is closed" in caplog.text
