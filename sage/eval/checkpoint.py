"""Checkpoints: what to load for a model folder (full weights, or a LoRA adapter on the base it names) and
a fingerprint that changes whenever its weights do."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from sage.config import ConfigError

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class Checkpoint:
    """What to load for a model folder: full weights, or a LoRA adapter on the base it names."""

    path: str
    base: str  # full weights: the folder itself, or the adapter's base_model_name_or_path
    adapter: str | None
    tokenizer: str

    @classmethod
    def resolve(cls, path: str) -> Checkpoint:
        folder = Path(path)
        if not (folder / ADAPTER_CONFIG).is_file():
            return cls(path=path, base=path, adapter=None, tokenizer=path)
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path to merge onto")
        tokenizer = path if (folder / "tokenizer_config.json").is_file() else base
        return cls(path=path, base=base, adapter=path, tokenizer=tokenizer)

    def fingerprint(self) -> str:
        """Changes exactly when what is sampled can: a hash of the name and CONTENT of every file of the
        folder(s), bar the records of how the folder was made (``NOT_MODEL_FILES``). A requeued job that
        saves the same weights again, or the same model copied elsewhere, keeps its finished cells. A hub id
        (no local folder) is its own fingerprint."""
        h = hashlib.sha256()
        for part in (self.base, self.adapter):
            if part is None:
                continue
            folder = Path(part)
            if not folder.is_dir():
                h.update(part.encode())
                continue
            for f in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in NOT_MODEL_FILES):
                h.update(f"{f.name}:{file_digest(f)}".encode())
        return h.hexdigest()[:16]


NOT_MODEL_FILES = frozenset({"training_args.bin", "trainer_state.json", "README.md", "sage_final.json"})
"""Written beside the weights but not read by a sampler: the run's arguments, state and model card."""


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, memoised per (path, size, mtime) so that one process hashes a large
    checkpoint once however often it is evaluated."""
    st = path.stat()
    return _digest(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
