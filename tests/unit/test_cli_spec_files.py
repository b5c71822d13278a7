"""`pagedserve generate --json-schema FILE / --grammar FILE` (:mod:`pagedserve.cluster.cli`):
a file that cannot be read, or is not UTF-8 text, is an ``error:`` naming the flag and exit 2,
before any call (the address below has no server)."""

from __future__ import annotations

import pytest

from pagedserve.cluster.cli import main


@pytest.mark.parametrize("flag", ["--grammar", "--json-schema"])
@pytest.mark.parametrize("content", [None, b"\xff\xfe root"])
def test_unreadable_spec_file_is_an_error_naming_the_flag(tmp_path, capsys, flag, content):
    path = tmp_path / "spec.txt"
    if content is not None:
        path.write_bytes(content)
    assert main(["generate", "--address", "127.0.0.1:9", flag, str(path), "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: cannot read {str(path)!r}: "), err
