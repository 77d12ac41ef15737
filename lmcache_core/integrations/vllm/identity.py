"""Model identity for the namespace: a name and a revision that never contain a path.

* A Hugging Face hub snapshot directory (``.../models--org--name/snapshots/<commit>``)
  or a hub id resolved offline gives ``org/name`` and the snapshot's commit.
* Any other local directory gives its base name and ``sha256:<hex>`` over ``config.json``,
  ``adapter_config.json`` (a LoRA adapter's rank, alpha and targets) and the weight files
  (names, sizes and contents). The digest is computed once and
  cached in a sidecar keyed by the files' names, sizes and mtimes, so later starts cost a
  few ``stat`` calls; a file lock keeps concurrent processes from hashing twice.

Paths and mtimes only decide whether the sidecar is fresh; they never enter a key.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ModelIdentity",
    "UnknownRevision",
    "adapter_revision",
    "model_identity",
    "weights_digest",
]

log = logging.getLogger("vllm.lmcache_core.identity")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")
#: Configuration files that change what the weights compute (hashed with them).
CONFIG_NAMES = ("config.json", "adapter_config.json")
SIDECAR_NAME = ".lmcache_core_revision.json"
_COMMIT = re.compile(r"[0-9a-f]{40}")


class UnknownRevision(Exception):
    """The model's revision cannot be determined; the message names the fix."""


@dataclass(frozen=True)
class ModelIdentity:
    """Name and revision recorded in the namespace."""

    name: str
    revision: str
    source: str  # "config", "hub-snapshot", "weights-sha256"


def _hub_snapshot(path: Path) -> tuple[str, str] | None:
    parts = path.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        repo = parts[-3][len("models--") :].replace("--", "/")
        return repo, parts[-1]
    return None


def _weight_files(path: Path) -> list[Path]:
    files = [p for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    for name in CONFIG_NAMES:
        cfg = path / name
        if cfg.is_file():
            files.append(cfg)
    return sorted(set(files), key=lambda p: p.relative_to(path).as_posix())


def _fingerprint(path: Path, files: list[Path]) -> list[list[object]]:
    out: list[list[object]] = []
    for f in files:
        st = f.stat()
        out.append([f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns])
    return out


def _sidecar_path(path: Path) -> Path:
    if os.access(path, os.W_OK):
        return path / SIDECAR_NAME
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "lmcache-core"
        / "revisions"
    )
    cache.mkdir(parents=True, exist_ok=True)
    tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return cache / f"{tag}.json"


def _read_sidecar(sidecar: Path, fingerprint: list[list[object]]) -> str | None:
    try:
        data = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("files") == fingerprint:
        rev = data.get("revision")
        return rev if isinstance(rev, str) else None
    return None


def weights_digest(path: str | os.PathLike[str]) -> str:
    """``sha256:<hex>`` of the configuration files (:data:`CONFIG_NAMES`) and the weight
    files under ``path`` (cached)."""
    root = Path(path)
    files = _weight_files(root)
    if not any(f.name not in CONFIG_NAMES for f in files):
        raise UnknownRevision(f"no weight files found under {root}")
    sidecar = _sidecar_path(root)
    fp = _fingerprint(root, files)
    cached = _read_sidecar(sidecar, fp)
    if cached:
        return cached
    lock_path = sidecar.with_name(sidecar.name + ".lock")
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_sidecar(sidecar, fp)
        if cached:
            return cached
        log.info(
            "hashing the weights of %s once to name its revision (cached in %s)", root, sidecar
        )
        h = hashlib.sha256(b"lmcache-core/weights\x00")
        for f in files:
            rel = f.relative_to(root).as_posix().encode()
            h.update(len(rel).to_bytes(4, "little") + rel + f.stat().st_size.to_bytes(8, "little"))
            with open(f, "rb") as fh:
                while block := fh.read(8 << 20):
                    h.update(block)
        revision = "sha256:" + h.hexdigest()
        fd, tmp = tempfile.mkstemp(dir=sidecar.parent, prefix=".rev.")
        with os.fdopen(fd, "w") as out:
            json.dump({"files": _fingerprint(root, files), "revision": revision}, out)
        os.replace(tmp, sidecar)
        return revision


def _resolve_hub(model: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - vLLM depends on it
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def model_identity(
    model: str,
    *,
    served_name: str | None = None,
    revision: str | None = None,
    name_override: str | None = None,
    revision_override: str | None = None,
) -> ModelIdentity:
    """The name and revision of ``model`` (a local directory or a hub id).

    Overrides win. Raises :class:`UnknownRevision` when no revision can be found.
    """
    path = Path(model)
    snapshot = None
    if path.is_dir():
        snap = _hub_snapshot(path)
        name = snap[0] if snap else path.resolve().name
        snapshot = snap[1] if snap else None
    else:
        name = model
        if revision and _COMMIT.fullmatch(revision):
            snapshot = revision
        else:
            resolved = _resolve_hub(model, revision)
            if resolved is not None:
                snap = _hub_snapshot(resolved)
                snapshot = snap[1] if snap else None
                if snapshot is None:
                    path = resolved
    if served_name and served_name != model and not name_override:
        name = served_name
    name = name_override or name
    if revision_override:
        return ModelIdentity(name, revision_override, "config")
    if snapshot is not None:
        return ModelIdentity(name, snapshot, "hub-snapshot")
    if path.is_dir():
        return ModelIdentity(name, weights_digest(path), "weights-sha256")
    raise UnknownRevision(
        f"cannot determine the revision of model {model!r} (not a local directory or a "
        "cached hub snapshot); set kv_connector_extra_config.model_revision"
    )


def adapter_revision(lora_path: str) -> str:
    """The revision of a LoRA adapter given as vLLM's ``lora_path``, resolved like the
    model: a local directory (``~`` expanded, relative to the working directory as vLLM
    takes it) gives the ``sha256:`` digest of its weights and ``adapter_config.json``; a
    hub id gives the commit of its cached snapshot, looked up offline (vLLM's worker
    downloads it). Raises :class:`UnknownRevision` when neither is found."""
    try:
        return model_identity(os.path.expanduser(lora_path)).revision
    except UnknownRevision:
        raise UnknownRevision(
            f"LoRA adapter {lora_path!r} is neither a local directory with weight files "
            "nor a hub snapshot in the local cache"
        ) from None
