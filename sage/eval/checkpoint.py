"""Checkpoints: what to load for a model folder (full weights, or a LoRA adapter on the base it names) and
a fingerprint that changes whenever its weights do."""

from __future__ import annotations

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
        """Changes whenever the weights do: resolved path, then name, size and mtime of every file of the
        folder(s). A hub id (no local folder) is its own fingerprint."""
        h = hashlib.sha256()
        for part in (self.base, self.adapter):
            if part is None:
                continue
            folder = Path(part)
            if not folder.is_dir():
                h.update(part.encode())
                continue
            h.update(str(folder.resolve()).encode())
            for f in sorted(p for p in folder.iterdir() if p.is_file()):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()[:16]
