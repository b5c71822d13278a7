"""Model resolution: folders, cache location, errors, and atomic conversion."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.worker import model_store
from pagedserve.worker.config import ModelConfig
from pagedserve.worker.model_store import (
    ModelStoreError,
    cache_root,
    convert_gguf,
    resolve_model,
    validate_hf_folder,
)


def test_hf_folder_used_as_is(tiny_llama_dir: Path) -> None:
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()
    assert resolve_model(ModelConfig(model=str(tiny_llama_dir))) == tiny_llama_dir.resolve()


def test_incomplete_folders_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelStoreError, match=r"missing \*\.safetensors weights"):
        validate_hf_folder(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelStoreError, match=r"missing config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelStoreError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelStoreError, match=r"not an existing \.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(model_store.CACHE_ENV)
    assert cache_root() == Path.home() / ".cache" / "pagedserve"


def test_interrupted_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake")
    cache = tmp_path / "cache"

    def half_then_crash(src: Path, out: Path, progress: bool) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_store, "_save_converted", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, cache, progress=False)
    # Only the lock file remains: no final folder, no temp folder.
    assert [p.suffix for p in cache.iterdir()] == [".lock"]

    def copy_tiny(src: Path, out: Path, progress: bool) -> None:
        for f in tiny_llama_dir.iterdir():
            (out / f.name).write_bytes(f.read_bytes())

    monkeypatch.setattr(model_store, "_save_converted", copy_tiny)
    first = convert_gguf(gguf, cache, progress=False)
    assert first.parent == cache and first.name.startswith("tiny-")
    assert (first / "config.json").is_file()
    assert not list(cache.glob(".tiny-*.tmp-*"))
    # Cached: a second call converts nothing.
    monkeypatch.setattr(model_store, "_save_converted", half_then_crash)
    assert convert_gguf(gguf, cache, progress=False) == first


def test_weights_digest_tracks_the_bytes_and_is_cached(tmp_path: Path) -> None:
    import hashlib

    from pagedserve.worker.model_store import DIGEST_FILE, weights_digest

    (tmp_path / "model.safetensors").write_bytes(b"abc")
    expected = hashlib.sha256(b"model.safetensors\0abc").hexdigest()
    assert weights_digest(tmp_path) == expected
    assert (tmp_path / DIGEST_FILE).is_file()
    assert weights_digest(tmp_path) == expected  # from the cache
    (tmp_path / "model.safetensors").write_bytes(b"abd!")  # new size: hashed again
    assert weights_digest(tmp_path) == hashlib.sha256(b"model.safetensors\0abd!").hexdigest()
    with pytest.raises(ModelStoreError, match=r"no \*\.safetensors"):
        weights_digest(tmp_path / "empty")


def test_worker_model_spec_is_node_independent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedserve.worker.model_store import worker_model_spec

    monkeypatch.chdir(tmp_path)
    assert worker_model_spec("default") == "default"
    assert worker_model_spec("models/x.gguf") == str(tmp_path / "models" / "x.gguf")
    assert worker_model_spec(str(tmp_path / "m")) == str(tmp_path / "m")
