"""Checkpoints: what to load for a model folder (full weights, or a LoRA adapter on the base it names) and
a fingerprint that changes whenever its weights do."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from sage.config import ConfigError
from sage.durable import file_digest

ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# A tokenizer folder holds tokenizer_config.json and the vocabulary in one of these forms.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
WHAT_A_CHECKPOINT_HOLDS = (
    "a model folder holds config.json, its weights (model.safetensors) and its tokenizer "
    "(tokenizer_config.json, tokenizer.json); a LoRA adapter folder holds adapter_config.json and "
    "adapter_model.safetensors"
)


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


def check_checkpoint_folder(path: str) -> None:
    """A checkpoint folder a sampler can load: the config, weights and tokenizer files it needs exist, are
    not empty and parse (JSON files; a safetensors file's header), and a LoRA adapter's local base is such a
    folder too. Checked before any results folder or MLflow run is made, so an empty, half-copied or
    corrupt folder is one line naming the file instead of a loader's traceback about something else."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint={path} is not a folder; for a hub model leave checkpoint unset")
    if (folder / ADAPTER_CONFIG).exists():
        adapter = _json_file(path, folder / ADAPTER_CONFIG)
        _weights(path, folder, ADAPTER_WEIGHT_FILES)
        base = adapter.get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"checkpoint={path}: {ADAPTER_CONFIG} names no base_model_name_or_path")
        local_base = Path(base).is_absolute() or Path(base).exists()
        if local_base:
            try:
                check_checkpoint_folder(base)
            except ConfigError as e:
                raise ConfigError(f"checkpoint={path}: the adapter's base: {e}") from None
        if (folder / "tokenizer_config.json").exists():  # else the base's tokenizer (Checkpoint.resolve)
            _tokenizer(path, folder)
        return
    if not (folder / "config.json").exists():
        raise ConfigError(
            f"checkpoint={path} holds neither config.json nor {ADAPTER_CONFIG}: {WHAT_A_CHECKPOINT_HOLDS}"
        )
    _json_file(path, folder / "config.json")
    _weights(path, folder, WEIGHT_FILES)
    _tokenizer(path, folder)


def _json_file(checkpoint: str, file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise ConfigError(f"checkpoint={checkpoint}: {file.name} is not readable JSON ({reason})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"checkpoint={checkpoint}: {file.name} is not a JSON object")
    return data


def _weights(checkpoint: str, folder: Path, names: tuple[str, ...]) -> None:
    found = [folder / n for n in names if (folder / n).exists()]
    if not found:
        raise ConfigError(
            f"checkpoint={checkpoint} holds no weights (none of {', '.join(names)}): "
            f"{WHAT_A_CHECKPOINT_HOLDS}"
        )
    for file in found:
        if file.name.endswith(".index.json"):
            shards = set(_json_file(checkpoint, file).get("weight_map", {}).values())
            for shard in sorted(shards):
                _weight_file(checkpoint, folder / shard)
        else:
            _weight_file(checkpoint, file)


def _weight_file(checkpoint: str, file: Path) -> None:
    if not file.is_file():
        raise ConfigError(f"checkpoint={checkpoint}: weight file {file.name} is missing")
    problem = weight_file_problem(file)
    if problem is not None:
        raise ConfigError(f"checkpoint={checkpoint}: weight file {problem}")


def weight_file_problem(file: Path) -> str | None:
    """Why a weight file cannot be loaded, read from its framing without loading any tensor; None if it
    can. A safetensors file is an 8-byte little-endian header length, that many bytes of JSON, then the
    tensors' bytes, the last of which ends at the largest ``data_offsets`` end: a truncated copy keeps a
    whole header and lacks bytes, a foreign file has no such header. (Used by sage-eval and by sage-train
    on its checkpoints.)"""
    size = file.stat().st_size
    if size == 0:
        return f"{file.name} is empty"
    if file.suffix != ".safetensors":
        return None
    with open(file, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        header = None
        if 0 < length <= size - 8:
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
    if not isinstance(header, dict):
        return f"{file.name} is not a readable safetensors file"
    try:
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return f"{file.name} is not a readable safetensors file"
    expected = 8 + length + end
    if size != expected:
        what = "is cut short" if size < expected else "has bytes its header does not describe"
        return f"{file.name} {what} ({size} bytes; the header describes {expected})"
    return None


def _tokenizer(checkpoint: str, folder: Path) -> None:
    if not (folder / "tokenizer_config.json").exists():
        raise ConfigError(
            f"checkpoint={checkpoint} holds no tokenizer_config.json: {WHAT_A_CHECKPOINT_HOLDS}"
        )
    _json_file(checkpoint, folder / "tokenizer_config.json")
    vocab = [folder / n for n in VOCAB_FILES if (folder / n).exists()]
    if not vocab:
        raise ConfigError(
            f"checkpoint={checkpoint} holds no tokenizer vocabulary (none of {', '.join(VOCAB_FILES)})"
        )
    for file in vocab:
        if file.stat().st_size == 0:
            raise ConfigError(f"checkpoint={checkpoint}: tokenizer file {file.name} is empty")
    if (folder / "tokenizer.json").exists():
        _json_file(checkpoint, folder / "tokenizer.json")


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
"""Where transformers saves a tokenizer's chat template (older versions: tokenizer_config.json's key)."""


def has_chat_template(folder: Path) -> bool | None:
    """Whether the tokenizer saved in ``folder`` has a chat template; None when it is not a local folder
    (a hub id, which is not downloaded to find out)."""
    if not (folder / "tokenizer_config.json").is_file():
        return None
    if any((folder / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))


def check_prompt_format(path: str, chat: bool) -> None:
    """The model option's prompt format (``model.chat``) must be the checkpoint's: a checkpoint trained on
    chat turns has a chat template in its tokenizer, one trained on bare text has none. Either mismatch
    is one line, before anything is created: a chat option on a bare tokenizer cannot render its prompts,
    and bare prompts to a chat model would be scored in a format it was never trained on."""
    templated = has_chat_template(Path(Checkpoint.resolve(path).tokenizer))
    if templated is None or templated == chat:
        return
    if chat:
        raise ConfigError(
            f"checkpoint={path} has a bare-text tokenizer (no chat template) but model.chat=true: choose the "
            "model option it was trained with (e.g. model=tiny), or one with chat: false"
        )
    raise ConfigError(
        f"checkpoint={path} has a chat tokenizer (a chat template) but model.chat=false: choose the model "
        "option it was trained with (e.g. model=tiny_chat), or one with chat: true"
    )


def training_run(checkpoint: Path) -> Path | None:
    """The sage-train run folder that saved ``checkpoint`` (its ``final/``, ``final-step-N/`` or
    ``rl/checkpoint-N/``): the folder holding the run's config.yaml and Hydra's record of its choices
    (.hydra/hydra.yaml); None for a folder no sage-train run saved."""
    run = checkpoint.parent.parent if checkpoint.parent.name == "rl" else checkpoint.parent
    if (run / "config.yaml").is_file() and (run / ".hydra" / "hydra.yaml").is_file():
        return run
    return None


def check_model_option(path: str, model_cfg, model_choice: str | None) -> None:
    """A sage-train checkpoint must be evaluated under the model option it was trained from: its run's
    ``model.source`` (what the weights started as: their architecture, tokenizer and, for the testbed, the
    world they were trained on). Another option's prompt format, lengths and dtype would be applied to
    weights made for others, so the mismatch is one line naming both options, before anything is created.
    A folder no sage-train run saved is not checked here (its prompt format is, by check_prompt_format)."""
    from omegaconf import OmegaConf

    run = training_run(Path(path))
    if run is None:
        return
    try:
        trained = OmegaConf.load(run / "config.yaml")
        choice = OmegaConf.load(run / ".hydra" / "hydra.yaml").hydra.runtime.choices.get("model")
        source = OmegaConf.to_container(trained.model.source, resolve=False)
    except Exception:  # noqa: BLE001 (a damaged record of the run: nothing to compare against)
        return
    given = OmegaConf.to_container(model_cfg.source, resolve=False)
    if source == given:
        return
    differ = sorted(k for k in set(source) | set(given) if source.get(k) != given.get(k))
    raise ConfigError(
        f"checkpoint={path} was trained from model={choice} (its run's {run / 'config.yaml'}), but "
        f"model={model_choice or '?'} is given, whose model.source differs in {', '.join(differ)}: "
        f"evaluate it with model={choice}"
    )
