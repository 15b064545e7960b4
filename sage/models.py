"""Model sources: each `model=` option's ``source`` target returns what ``from_pretrained`` takes."""

from __future__ import annotations

import os
from pathlib import Path


def from_hub(repo_id: str) -> str:
    """A hub model id, or a local model folder (``model.source.repo_id=/path``: a copy on the cluster's
    disk, an earlier run's checkpoint). Fails now, with the id named, if the hub is unreachable and the
    model is not cached, rather than deep inside TRL after datasets and configs have been built."""
    if Path(repo_id).is_dir():
        return str(Path(repo_id).resolve())
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    try:
        return snapshot_download(
            repo_id, local_files_only=offline, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except LocalEntryNotFoundError as e:
        raise RuntimeError(
            f"model {repo_id!r} is not in the local hub cache and the hub is not reachable: {e}"
        ) from e
    except Exception as e:  # network errors come in many types; all mean the same thing to the user
        raise RuntimeError(
            f"model {repo_id!r} could not be fetched from the hub ({type(e).__name__}: {e})"
        ) from e
