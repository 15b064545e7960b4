"""`make wheelhouse`: the wheels a GPU machine without network needs to run sage, into ``wheelhouse/``.

    python -m launchers.wheelhouse [--out wheelhouse] [--python 3.12 --python 3.11]   # make wheelhouse
    python -m launchers.wheelhouse --check [--out wheelhouse]                          # is it complete?

The machine it is for is the GPU machine this workplace lends now and then (docs/results/gpu_check.md): CUDA
torch, transformers, peft, accelerate and a scientific Python stack installed (:data:`IMAGE`), no network.
What sage needs beyond that image is carried as wheels, at the versions installed here, which the test suite
runs against: the dependency closure of sage's own requirements, walked through this environment's package
metadata, less what the image holds and less :data:`LEFT_OUT` (MLflow's stack: the GPU check runs with
``tracking.enabled=false``, and sage imports MLflow only to record), plus sage's own wheel. Pure-Python wheels
where a package publishes one (they install on any Python), else the machine's Python's manylinux wheel, else
a wheel built here from the sdist (antlr4-python3-runtime 4.9.3 publishes no wheel).

It also carries the testbed model stage a of the GPU check starts from (``wheelhouse/testbed/``, a few MiB,
trained here once and cached like every testbed model), which the check copies into the machine's model
cache instead of training it there (``--no-testbed``: wheels only).

``wheelhouse/requirements.txt`` pins every carried package; ``make gpu-check`` installs exactly that set with
``pip install --no-index --no-deps --find-links wheelhouse --target ...``: ``--no-deps``, because pip would
otherwise also resolve what the image already holds, and MLflow. ``--check`` is what makes ``--no-deps``
safe: every requirement of every carried wheel (for the target Pythons, on Linux x86-64) is met by a carried
wheel at an admitted version, by a package of the image (at an admitted version where the image's is known),
or is left out on purpose; one version per package; each pinned wheel installable there (pip's own dry run);
and the whole under :data:`MAX_MIB`. It exits 1 and names each problem otherwise.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
SAGE = "sage-rlvr"
# the lent machines' Python is 3.12 (docs/results/gpu_check.md); 3.11 is what this project develops on
PYTHONS = ("3.12", "3.11")
MAX_MIB = 40.0
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# The lent GPU machine's Python packages, as its image was last read (the workplace's description of the
# kind, 2026-11-17): carried only when sage needs another version.
IMAGE = frozenset(
    canonicalize_name(n)
    for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)
# the image's versions that a session saw there (the rest are not known)
IMAGE_VERSIONS = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "tokenizers": "0.23.2",
    "safetensors": "0.8.0",
}
# on the image, but carried all the same: sage pins it exactly and the image's version is not known
CARRIED_ANYWAY = {
    "peft": "sage pins peft exactly (it wraps its LoRA layers); the image's version is not known"
}
# requirements of sage not carried, with their own requirements: what sage does without them there
LEFT_OUT = {
    "mlflow": "only recording imports it; the GPU check runs with tracking.enabled=false (about 23 MiB of "
    "wheels with its server stack)",
}


def target_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of the GPU machine (Linux x86-64, CPython ``python``)."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_version": "",
        "implementation_version": f"{python}.0",
    }


def applies(req: Requirement, extras: set[str], pythons: tuple[str, ...]) -> bool:
    """Whether ``req`` is needed on the machine, for any of ``pythons`` and the ``extras`` asked for."""
    if req.marker is None:
        return True
    return any(
        req.marker.evaluate({**target_environment(p), "extra": extra})
        for p in pythons
        for extra in (sorted(extras) or [""])
    )


def kind(name: str) -> str:
    """``carried``, ``image`` or ``left out``: how the machine gets the package ``name``."""
    name = canonicalize_name(name)
    if name in LEFT_OUT:
        return "left out"
    if name in IMAGE and name not in CARRIED_ANYWAY:
        return "image"
    return "carried"


def walk(requires_of, pythons: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """The packages to carry, ``{name: version}``, from ``requires_of(name) -> (version, [requirement
    strings])`` (None: not available), starting at sage; and the problems: a requirement the carried
    version or the image's known version does not admit, or a package to carry that is not available."""
    carried: dict[str, str] = {}
    problems: list[str] = []
    todo: list[tuple[str, set[str], str]] = [(SAGE, set(), "")]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras, why = todo.pop()
        key = (canonicalize_name(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        found = requires_of(name)
        if found is None:
            problems.append(f"{name} ({why}): not available to carry")
            continue
        version, requirements = found
        carried[canonicalize_name(name)] = version
        for line in requirements:
            req = Requirement(line)
            if not applies(req, extras, pythons):
                continue
            dep = canonicalize_name(req.name)
            how = kind(dep)
            if how == "left out":
                continue
            if how == "image":
                known = IMAGE_VERSIONS.get(dep)
                if known is not None and not req.specifier.contains(known, prereleases=True):
                    problems.append(f"{name} requires {req}, the image has {dep} {known}")
                continue
            dep_found = requires_of(dep)
            if dep_found is not None and not req.specifier.contains(dep_found[0], prereleases=True):
                problems.append(f"{name} requires {req}, the carried {dep} is {dep_found[0]}")
            todo.append((dep, set(req.extras), f"required by {name}"))
    return carried, problems


def installed(name: str) -> tuple[str, list[str]] | None:
    """``(version, requirements)`` of ``name`` as installed in this environment."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist.version, list(dist.requires or [])


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch(name: str, version: str, out: Path, pythons: tuple[str, ...]) -> str:
    """The wheels of ``name==version`` into ``out``: a pure-Python one if published (for each Python whose
    tag it has not already covered), else each Python's manylinux wheel, else one built from the sdist.
    Returns how it was got; raises RuntimeError with pip's last line if none could be."""
    spec = f"{name}=={version}"
    common = ["download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(out)]
    got = []
    for python in pythons:
        if any(python_covered(w, python) for w in wheels_of(out, name, version)):
            continue
        pure = pip(
            *common,
            "--python-version",
            python,
            "--implementation",
            "py",
            "--abi",
            "none",
            "--platform",
            "any",
            spec,
        )
        if pure.returncode == 0:
            got.append("pure")
            continue
        binary = [f"--platform={p}" for p in MANYLINUX]
        abi = f"cp{python.replace('.', '')}"
        built = pip(
            *common, "--python-version", python, "--implementation", "cp", "--abi", abi, *binary, spec
        )
        if built.returncode == 0:
            got.append(f"{abi} binary")
            continue
        sdist = pip("wheel", "--no-deps", "-q", "-w", str(out), spec)
        if sdist.returncode == 0 and any(python_covered(w, python) for w in wheels_of(out, name, version)):
            got.append("built from its sdist")
            continue
        last = (sdist.stderr.strip() or built.stderr.strip() or "(no output)").splitlines()[-1]
        raise RuntimeError(f"{spec}: no wheel for Python {python} could be downloaded or built: {last}")
    return ", ".join(got) or "pure"


def wheels_of(folder: Path, name: str, version: str | None = None) -> list[Path]:
    out = []
    for w in folder.glob("*.whl"):
        wname, wversion, _, _ = parse_wheel_filename(w.name)
        if wname == canonicalize_name(name) and (version is None or str(wversion) == version):
            out.append(w)
    return out


def supported_tags(python: str) -> set:
    """Every wheel tag CPython ``python`` installs on Linux x86-64 (manylinux 2.17 to 2.28)."""
    from packaging import tags

    version = tuple(int(x) for x in python.split("."))
    platforms = [f"manylinux_2_{n}_x86_64" for n in range(28, 16, -1)] + [
        "manylinux2014_x86_64",
        "linux_x86_64",
    ]
    found = set(tags.cpython_tags(version, platforms=platforms))
    found |= set(tags.compatible_tags(version, f"cp{version[0]}{version[1]}", platforms))
    return found


def python_covered(wheel: Path, python: str) -> bool:
    return bool(parse_wheel_filename(wheel.name)[3] & supported_tags(python))


def build(out: Path, pythons: tuple[str, ...], testbed: bool = True) -> int:
    """Fill ``out`` (its old wheels removed) and print what each package is and how big the whole is."""
    carried, problems = walk(installed, pythons)
    if problems:
        print("\n".join(["cannot build the wheelhouse:", *problems]), file=sys.stderr)
        return 1
    carried.pop(SAGE)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()

    def one(item: tuple[str, str]) -> str:
        name, version = item
        return f"{name}=={version}: {fetch(name, version, out, pythons)}"

    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            lines = list(pool.map(one, sorted(carried.items())))
    except RuntimeError as e:
        print(f"cannot build the wheelhouse: {e}", file=sys.stderr)
        return 1
    had_build = (REPO / "build").exists()
    r = pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO))
    if not had_build:  # setuptools builds in the tree; its scratch folder is not ours to keep
        shutil.rmtree(REPO / "build", ignore_errors=True)
    if r.returncode != 0:
        print(f"cannot build sage's wheel: {r.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    version = metadata.version(SAGE)
    pins = sorted(carried.items()) + [(SAGE, version)]
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins))
    print("\n".join(lines + [f"{SAGE}=={version}: built here"]))
    shutil.rmtree(out / "testbed", ignore_errors=True)
    if testbed:
        print(f"testbed model: {carry_testbed(out)}")
    print(f"wheelhouse: {len(pins)} packages, {size_mib(out):.1f} MiB in {out}")
    problems = check(out, pythons)
    print("\n".join(problems) if problems else "check: complete (python -m launchers.wheelhouse --check)")
    return 1 if problems else 0


def carry_testbed(out: Path) -> Path:
    """Stage a's base model (built here if it is not cached) into ``out/testbed/<its cache name>``."""
    from hydra import compose, initialize_config_dir

    from launchers.gpu_check import stage_a
    from sage.config import register_configs
    from sage.paths import CONF_DIR
    from sage.targets import instantiate_node

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=stage_a(out / "unused"))
    built = Path(instantiate_node(cfg.model.source))
    dest = out / "testbed" / built.name
    shutil.copytree(built, dest)
    return dest


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def wheel_metadata(wheel: Path) -> tuple[str, list[str]]:
    """(version, Requires-Dist lines) read from the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    return meta["Version"], list(meta.get_all("Requires-Dist") or [])


def check(out: Path, pythons: tuple[str, ...] = PYTHONS) -> list[str]:
    """The problems of the wheelhouse ``out`` (none: it is complete); see the module's docstring."""
    problems = []
    versions: dict[str, set[str]] = {}
    for w in sorted(out.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(w.name)
        versions.setdefault(name, set()).add(str(version))
    for name, found in sorted(versions.items()):
        if len(found) > 1:
            problems.append(f"{name}: several versions ({', '.join(sorted(found))}); pip installs one")

    def carried(name: str) -> tuple[str, list[str]] | None:
        wheels = wheels_of(out, name)
        return wheel_metadata(wheels[0]) if wheels else None

    needed, missing = walk(carried, pythons)
    problems += missing
    for name in sorted(set(versions) - set(needed)):
        problems.append(f"{name}: carried but not needed")
    for python in pythons:
        for name in sorted(needed):
            if not any(python_covered(w, python) for w in wheels_of(out, name)):
                problems.append(f"{name}: no wheel installs on Python {python}")
    pins = out / "requirements.txt"
    if not pins.is_file():
        problems.append(f"{pins}: missing")
    else:
        pinned = {canonicalize_name(line.split("==")[0]) for line in pins.read_text().split()}
        if pinned != set(needed):
            problems.append(
                f"{pins}: pins {sorted(pinned ^ set(needed))} differently from the wheels' closure"
            )
        for python in pythons:
            problems += pip_dry_run(out, python)
    if size_mib(out) > MAX_MIB:
        problems.append(f"{size_mib(out):.1f} MiB, over the {MAX_MIB:.0f} MiB a call carries beside the code")
    return problems


def pip_dry_run(out: Path, python: str) -> list[str]:
    """pip's own resolution of ``make gpu-check``'s install, offline, for CPython ``python`` on Linux."""
    with tempfile.TemporaryDirectory() as target:
        r = pip(
            "install",
            "--dry-run",
            "--no-index",
            "--no-deps",
            "--find-links",
            str(out),
            "--target",
            target,
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            *[f"--platform={p}" for p in MANYLINUX],
            "-r",
            str(out / "requirements.txt"),
        )
    if r.returncode != 0:
        return [f"pip install --dry-run for Python {python}: {r.stderr.strip()[-1500:]}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "wheelhouse", help="the wheelhouse folder")
    parser.add_argument(
        "--python",
        action="append",
        help=f"the GPU machine's Python (repeatable; default {' '.join(PYTHONS)})",
    )
    parser.add_argument("--check", action="store_true", help="check an existing wheelhouse only")
    parser.add_argument(
        "--no-testbed", action="store_true", help="wheels only, without stage a's testbed model"
    )
    args = parser.parse_args(argv)
    pythons = tuple(args.python or PYTHONS)
    if args.check:
        problems = check(args.out, pythons)
        print("\n".join(problems) if problems else f"complete: {size_mib(args.out):.1f} MiB in {args.out}")
        return 1 if problems else 0
    return build(args.out, pythons, testbed=not args.no_testbed)


if __name__ == "__main__":
    sys.exit(main())
