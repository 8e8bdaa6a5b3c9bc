"""The wheels the device machine lacks, for the two parts of the device check (`tools.gpu_check`).

    make device-wheels                                   # = python -m tools.device_wheels
    python -m tools.device_wheels --part core            # one part

The GPU machine this project is lent (docs/development.md, "The device check") has Python 3.12,
torch, transformers, peft, accelerate and the scientific stack, no network, and takes at most
64 MiB per command: the working tree (about 3.5 MB) plus what the command carries. This writes,
into the git-ignored `.device/`:

- `.device/core/`: the wheels `gpu_check core` needs (pydantic's four and bitsandbytes), at the
  versions of `requirements.lock`, within `CORE_BUDGET_MB`;
- `.device/pipeline/`: every wheel `qllm run` of the tiny profile needs that the machine lacks
  (DVC, Prefect, MLflow's client, their dependencies);
- `.device/smollm2/`: SmolLM2-135M-Instruct's config and tokenizer without its weights
  (`gpu_check smollm2-shape`; needs `make install-smollm2`).

Each part's set is the closure of its roots resolved for CPython 3.12 on manylinux x86-64 under
`requirements.lock` (`uv pip compile`), less the machine's packages (`MACHINE`, from the device
tool's list) and less `LEFT_OUT` (each with the reason it is not needed there). A package with no
3.12 wheel (a pure-Python sdist) is built into one here. It prints what each command carries
(wheels, working tree, shape) and fails (exit 1) when that is over 64 MiB less a margin, or the
core's wheels over their 50 MB.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEST = REPO / ".device"
"""Git-ignored: what the device commands carry (`carry: [.device/core, .device/smollm2]`, then `[.device/pipeline]`)."""
MIB = 2**20
CARRY_LIMIT_MIB = 64
"""What one device command carries in all: the working tree (tracked and untracked files git does
not ignore) and the paths it names in `carry` (a part's wheels; the SmolLM2 shape for the core)."""
MARGIN_MIB = 1
"""Kept free under the limit, for the working tree to grow between this and the device run."""
CORE_BUDGET_MB = 50
"""The issue's budget for the core's wheels (pydantic's four and bitsandbytes)."""

MACHINE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi charset-normalizer
chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler
cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio
h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())  # noqa: SIM905 - a list read off the device tool, kept as it reads
"""The packages of the device machine's image ('cuda', read on 2026-11-17: the device tool's
KINDS.md). Python 3.12.3, torch 2.11.0+cu130, transformers 5.17.0, accelerate 1.15.0."""

MACHINE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "tokenizers": "0.23.2", "safetensors": "0.8.0", "accelerate": "1.15.0",
                    "huggingface-hub": "1.33.0", "numpy": "2.5.2", "sentencepiece": "0.2.2"}  # fmt: skip
"""The versions read on the machine (KINDS.md's pip list); the rest of a rehearsal venv takes the lock's."""

BUILD_TOOLS = frozenset({"pip", "setuptools", "wheel"})
"""Left to the venv and to torch's own requirements (torch 2.11 asks setuptools < 82, the lock has newer)."""

CORE_ROOTS = ("pydantic", "bitsandbytes")
"""The core imports the project's training code (pydantic: its params) and QLoRA nf4 (bitsandbytes)."""
PIPELINE_SWAPS = {"mlflow": ("mlflow-skinny", "sqlalchemy", "alembic")}
"""The full `mlflow` adds its server and UI (Flask, gunicorn, GraphQL, the JS bundle); a pipeline
run needs the client and the SQLite store: mlflow-skinny with SQLAlchemy and Alembic."""
LEFT_OUT = {  # from the pipeline part
    "torch": "on the machine (its own CUDA build)",
    "bitsandbytes": "the core's (41 MiB); the tiny profile trains no QLoRA",
    "apprise": "Prefect's notification blocks (imported when a notification is sent): the run sends none",
    "dvc-ssh": "DVC remotes over SSH: no remote on the device",
}
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux1_x86_64")  # fmt: skip


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return norm(re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0])


def roots(part: str) -> list[str]:
    if part == "core":
        return list(CORE_ROOTS)
    names = []
    for requirement in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        name = _name(requirement)
        names += PIPELINE_SWAPS.get(name, () if name in LEFT_OUT else (name,))
    return names


def resolve(part: str) -> list[str]:
    """`name==version` of every distribution the part's roots need, resolved for CPython 3.12 on
    manylinux x86-64 under requirements.lock."""
    uv = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "roots.txt").write_text("\n".join(roots(part)) + "\n")
        done = subprocess.run([uv, "pip", "compile", "roots.txt", "--python-version", "3.12", "--python-platform", "x86_64-manylinux_2_28",
                               "-c", str(REPO / "requirements.lock"), "--no-header", "--no-annotate", "-q"], cwd=tmp,
                              capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"device_wheels: uv pip compile for {part} failed:\n{done.stderr[-2000:]}")
    return [line.strip() for line in done.stdout.splitlines() if "==" in line and not line.startswith("#")]


def closure(part: str) -> list[str]:
    """What the part carries: its resolution less the machine's packages and `LEFT_OUT`, sorted."""
    left_out = LEFT_OUT if part == "pipeline" else {}
    return sorted(pin for pin in resolve(part) if not on_machine(_name(pin)) and _name(pin) not in left_out)


def machine_requirements() -> list[str]:
    """Pins for a CPU rehearsal venv holding the machine's packages the two parts use: the versions
    read there (`MACHINE_VERSIONS`), else the lock's; NVIDIA's libraries come with torch."""
    pins = {_name(pin): pin for part in ("core", "pipeline") for pin in resolve(part) if _name(pin) in MACHINE and _name(pin) not in BUILD_TOOLS and not _torchs(_name(pin))}
    pins |= {name: f"{name}=={version}" for name, version in MACHINE_VERSIONS.items()}
    return sorted(pins.values())


def on_machine(name: str) -> bool:
    """In the machine's image; NVIDIA's and CUDA's libraries are its torch build's own (cu130)."""
    return name in MACHINE or _torchs(name)


def _torchs(name: str) -> bool:
    """A library a CUDA build of torch brings with it (installed with torch, at torch's pins)."""
    return name.startswith(("nvidia-", "cuda-")) or name == "triton"


def download(pin: str, dest: Path) -> Path:
    """The wheel of `pin` for CPython 3.12 on manylinux x86-64 into `dest`; a pure-Python sdist built here."""
    before = set(dest.glob("*.whl"))
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", *platforms, "-d", str(dest), pin]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:  # no wheel: build the sdist (pure Python) into a py3-none-any wheel
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), pin],
            capture_output=True,
            text=True,
        )
        if built.returncode != 0:
            raise SystemExit(
                f"device_wheels: {pin}: no 3.12 wheel and no build:\n{done.stderr[-800:]}\n{built.stderr[-800:]}"
            )
    new = set(dest.glob("*.whl")) - before
    if len(new) != 1:
        matching = [w for w in dest.glob("*.whl") if norm(w.name.split("-")[0]) == _name(pin)]
        if len(matching) == 1:
            return matching[0]
        raise SystemExit(f"device_wheels: {pin}: expected one wheel, got {sorted(w.name for w in new)}")
    (wheel,) = new
    if not runs_there(wheel.name):
        raise SystemExit(f"device_wheels: {wheel.name} does not install on CPython 3.12, manylinux x86-64")
    return wheel


def runs_there(filename: str) -> bool:
    """Whether a wheel's tags fit CPython 3.12 on manylinux x86-64 (what the device machine is)."""
    from packaging import tags
    from packaging.utils import parse_wheel_filename

    supported = {*tags.cpython_tags((3, 12), platforms=PLATFORMS), *tags.compatible_tags((3, 12), "cp312", PLATFORMS)}
    return bool(parse_wheel_filename(filename)[3] & supported)


def fill(part: str, dest: Path) -> list[Path]:
    """`dest` holds exactly the part's wheels (others removed)."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = closure(part)
    wheels = []
    for pin in pins:
        name, version = pin.split("==")
        have = [
            w
            for w in dest.glob("*.whl")
            if norm(w.name.split("-")[0]) == norm(name) and w.name.split("-")[1] == version
        ]
        wheels.append(have[0] if have else download(pin, dest))
    for stale in set(dest.glob("*.whl")) - set(wheels):
        stale.unlink()
    return sorted(wheels)


def tree_mib() -> float:
    """The working tree a device command sends: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return (
        sum((REPO / name).stat().st_size for name in listed.decode().split("\0") if name and (REPO / name).is_file())
        / MIB
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.device_wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["core", "pipeline", "all"], default="all")
    parser.add_argument(
        "--machine-requirements",
        metavar="FILE",
        help="write the rehearsal venv's pins (the machine's packages) to FILE, and stop",
    )
    args = parser.parse_args(argv)
    if args.machine_requirements:
        Path(args.machine_requirements).write_text("\n".join(machine_requirements()) + "\n")
        return 0
    tree, over = tree_mib(), []
    for part in ("core", "pipeline") if args.part == "all" else (args.part,):
        wheels = fill(part, DEST / part)
        total = sum(w.stat().st_size for w in wheels) / MIB
        largest = ", ".join(
            f"{w.name.split('-')[0]} {w.stat().st_size / MIB:.1f}"
            for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:4]
        )
        carried = tree + total
        extra = ""
        if part == "core":
            from tools.gpu_check import SMOLLM2_SHAPE, smollm2_shape

            shape = REPO / SMOLLM2_SHAPE
            if not (shape / "config.json").exists():
                smollm2_shape(shape)
            shape_mib = sum(f.stat().st_size for f in shape.iterdir()) / MIB
            carried += shape_mib
            extra = f" + SmolLM2 shape {shape_mib:.1f}"
            if total * MIB > CORE_BUDGET_MB * 1e6:
                over.append(f"core's wheels are {total * MIB / 1e6:.1f} MB, over the {CORE_BUDGET_MB} MB budget")
        print(f"{part}: {len(wheels)} wheels {total:.1f} MiB (largest: {largest}) + working tree {tree:.1f}{extra} = {carried:.1f} MiB "
              f"of the {CARRY_LIMIT_MIB} MiB a command carries")  # fmt: skip
        if carried > CARRY_LIMIT_MIB - MARGIN_MIB:
            over.append(f"{part} carries {carried:.1f} MiB, over {CARRY_LIMIT_MIB} MiB less a {MARGIN_MIB} MiB margin")
    if over:
        print("device_wheels: " + "; ".join(over), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
