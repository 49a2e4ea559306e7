"""The GPU kit: the packages a bare CUDA image lacks, carried to an air-gapped GPU machine in parts of at most 60 MiB.

A bare GPU image has PyTorch, transformers and accelerate (and what they need) but not Ray, verl, Hydra, diffusers,
peft, rapidocr and the rest, and often reaches no package index. ``bash scripts/gpu_kit.sh pack`` (where PyPI is
reachable) computes the packages to carry, has pip put their wheels for the GPU machine's interpreter (default
CPython 3.12, manylinux x86_64) into a staging folder at the lock's versions (``requirements/constraints-cpu.txt``),
removes what the product never imports (:data:`TRIM`), compresses the folder (tar + xz), splits the archive into
parts and writes a manifest. ``bash scripts/gpu_kit.sh run`` on the GPU machine checks every part's sha256, joins
them while extracting into a prefix outside the tree and runs the checks. Only the standard library is used by the
``install``/``verify`` side (the GPU machine has nothing else yet); ``packages`` (pack side) uses ``packaging``.

The packages to carry are the closure of the project's dependencies (``omni-async``'s requirements plus
:data:`TEST_PACKAGES`, with markers evaluated for the target interpreter) less the closure of :data:`BASE_PACKAGES`
(what the image has) and :data:`DROP` (distributions the product never imports), read from this environment's
installed metadata, each pinned to the lock's version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import tarfile
from collections.abc import Container, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

PART_BYTES = 60 * 2**20  # the largest piece one transfer carries to the GPU machine
ARCHIVE = "kit.tar.xz"
MANIFEST = "manifest.json"
STAMP = ".omni_async_kit.json"  # written into the prefix after a complete install: its archive's sha256
CHUNK = 2**20
FORMAT = 1

# What a CUDA image of PyTorch ships with (their own dependencies come with them): never carried.
BASE_PACKAGES = ("torch", "transformers", "accelerate")
# The GPU tier's runner (pyproject's dev extra, less the linters and the CPU suite's xdist and hypothesis).
TEST_PACKAGES = ("pytest", "pytest-asyncio", "pytest-timeout")
# Distributions in the closure that the product never imports, with the reason (each was checked by the dry run
# that installs the kit into a clean prefix and trains under Ray with it: docs/gpu_and_memory.md).
DROP = {
    "wandb": "verl's Tracking imports it only for trainer.logger=wandb, which the config refuses without it",
    "py-spy": "Ray's dashboard profiler only",
    "virtualenv": "Ray's runtime_env pip/uv plugins only (the trainer sets no runtime_env packages)",
    "datasets": "verl's RLHFDataset only; the trainer reads its files with pyarrow / json (trainer/dataset.py)",
    "pandas": "datasets' and verl's dataframe paths only",
    "multiprocess": "datasets only",
    "xxhash": "datasets only",
}
# Extras not followed into a kit packed against the target's list (``--have``): Ray's ``default`` extra is its
# dashboard, metrics agents and cloud log readers; without them Ray runs as its minimal install (``pip install ray``),
# which is all the trainer starts (``include_dashboard=False``). A package the extra brings that something else
# needs stays (fastapi imports opentelemetry-api). The full kit keeps the extra, as its dry run checked.
EXTRAS_NOT_FOLLOWED = {
    "ray": "Ray's dashboard and metrics agents only (the trainer starts Ray with include_dashboard=False)"
}
# Carried even when the target has them: the versions the LoRA paths are tested with (peft's adapter layout and
# target matching change between releases).
MUST_MATCH = ("peft",)
# Paths inside the staged site-packages the product never imports, removed before compression (globs).
TRIM = (
    "ray/jars",  # Ray's Java workers
    "ray/rllib",
    "ray/serve",
    "ray/data",
    "ray/tune",
    "ray/train",
    "ray/llm",
    "ray/dashboard/client",  # the dashboard's web front-end (the trainer starts Ray without the dashboard)
    "pyarrow/tests",
    "pyarrow/include",
    "pyarrow/src",
    "pyarrow/*flight*",  # Arrow Flight RPC (its library is 31 MB)
    "pyarrow/_s3fs*",
    "pyarrow/libarrow_s3*",  # pyarrow.fs skips S3 when its module is absent
    "pyarrow/_pyarrow_cpp_tests*",
    "*/tests",
    "bin",  # console scripts whose shebang names the packing interpreter
)


class KitError(RuntimeError):
    """A kit that cannot be installed as it is; the message names the file and the fix."""


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    sha256: str


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------------- pack


def canonical(name: str) -> str:
    """A distribution's canonical name (PEP 503: lower case, runs of ``-_.`` as ``-``)."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


def read_lock(lock: Path) -> dict[str, str]:
    """``name==version`` lines of the lock, keyed by :func:`canonical` name."""
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.strip()
    return pins


def closure(roots: Iterable[str], python: str, skip: Container[str] = (), no_extras: Container[str] = ()) -> set[str]:
    """Canonical names of ``roots`` and everything they require (extras followed, except those of ``no_extras``;
    ``skip`` and what only it requires left out), from this environment's installed metadata, with markers
    evaluated for CPython ``python`` on Linux x86_64."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
    }
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset() if name in no_extras else frozenset(req.extras))
        if key in seen or key[0] in skip:
            continue
        seen.add(key)
        try:
            dist = md.distribution(key[0])
        except md.PackageNotFoundError as e:
            raise KitError(f"{req.name} is not installed here: run `bash scripts/setup_env.sh` before packing") from e
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e}) for e in ("", *key[1])):
                todo.append(sub)
    return {name for name, _ in seen}


def read_have(path: Path) -> dict[str, str | None]:
    """The target's packages, from ``python3 -m pip list --format=freeze`` run there (``name==version``) or a list
    of bare names (version unknown), keyed by :func:`canonical` name."""
    have: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            have[canonical(name)] = version.strip() or None
    if not have:
        raise KitError(f"{path} names no package: write the target's `python3 -m pip list --format=freeze` into it")
    return have


def packages(lock: Path, python: str, have: dict[str, str | None] | None = None) -> dict[str, str]:
    """What the kit carries: name -> the lock's version. Without ``have``: the product's closure less
    :data:`BASE_PACKAGES`' closure. With ``have`` (the target's package list): only what the target lacks, plus
    :data:`MUST_MATCH` where the target's version differs from the lock's or is unknown; Ray's ``default`` extra is
    not followed (:data:`EXTRAS_NOT_FOLLOWED`; the kit then fits one transfer)."""
    pins = read_lock(lock)
    if have is None:
        carried = closure(["omni-async", *TEST_PACKAGES], python, skip=DROP) - closure(BASE_PACKAGES, python)
    else:
        carried = closure(["omni-async", *TEST_PACKAGES], python, skip=DROP, no_extras=EXTRAS_NOT_FOLLOWED)
        carried -= {n for n, v in have.items() if n not in MUST_MATCH or v == pins.get(n)}
    carried.discard("omni-async")  # the tree itself is on PYTHONPATH
    missing = sorted(n for n in carried if n not in pins)
    if missing:
        raise KitError(f"not pinned in {lock}: {', '.join(missing)}; add them to the lock (pip freeze) and pack again")
    return {n: pins[n] for n in sorted(carried)}


def trim(stage: Path, patterns: Iterable[str] = TRIM) -> list[str]:
    """Remove ``patterns`` (globs relative to ``stage``) and every ``__pycache__``; return what was removed."""
    removed = []
    for pattern in patterns:
        for path in sorted(stage.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            else:
                continue
            removed.append(str(path.relative_to(stage)))
    for cache in list(stage.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    return removed


# Ray ships its core binaries and extension with their symbol tables (a third of their size); only a debugger reads
# them.
STRIP = ("ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")


def strip_symbols(stage: Path, paths: Iterable[str] = STRIP) -> list[str]:
    """``strip --strip-unneeded`` the binaries ``paths`` (relative to ``stage``) where binutils' strip exists;
    return what was stripped."""
    import subprocess

    tool = shutil.which("strip")
    done = []
    for rel in paths:
        path = stage / rel
        if tool and path.is_file():
            subprocess.run([tool, "--strip-unneeded", str(path)], check=True)
            done.append(rel)
    return done


def split(archive: Path, out_dir: Path, part_bytes: int = PART_BYTES) -> list[Part]:
    """Cut ``archive`` into ``out_dir/<name>.000``, ``.001``, ... of at most ``part_bytes`` each."""
    if part_bytes <= 0:
        raise KitError(f"part size must be positive, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with archive.open("rb") as src:
        while True:
            name = f"{archive.name}.{len(parts):03d}"
            digest, size = hashlib.sha256(), 0
            with (out_dir / name).open("wb") as dst:
                while size < part_bytes and (block := src.read(min(CHUNK, part_bytes - size))):
                    dst.write(block)
                    digest.update(block)
                    size += len(block)
            if size == 0 and parts:
                (out_dir / name).unlink()
                break
            parts.append(Part(name, size, digest.hexdigest()))
            if size < part_bytes:
                break
    return parts


def write_manifest(out_dir: Path, archive: Path, parts: list[Part], **info: object) -> Path:
    """``manifest.json``: the parts (name, bytes, sha256), the joined archive's size and sha256, and ``info``
    (target interpreter, platform, packages and versions, what was trimmed)."""
    manifest = {
        "format": FORMAT,
        "archive": {"name": archive.name, "bytes": archive.stat().st_size, "sha256": sha256_of(archive)},
        "parts": [asdict(p) for p in parts],
        **info,
    }
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


# ------------------------------------------------------------------------------------------------------------- install


def load_manifest(kit: Path) -> dict:
    path = kit / MANIFEST
    if not path.is_file():
        raise KitError(f"{path} is missing: carry the kit folder's {MANIFEST} with its parts (`gpu_kit.sh pack`)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise KitError(f"{path} has format {manifest.get('format')}, this tool reads {FORMAT}: pack it again")
    return manifest


def verify(kit: Path, manifest: dict) -> list[str]:
    """Problems with the parts on disk (missing, wrong size, wrong sha256), one line each naming the part."""
    problems = []
    for part in manifest["parts"]:
        path = kit / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']}: missing (carry it into {kit})")
        elif path.stat().st_size != part["bytes"]:
            problems.append(f"{part['name']}: {path.stat().st_size} bytes, the manifest says {part['bytes']}")
        elif sha256_of(path) != part["sha256"]:
            problems.append(f"{part['name']}: sha256 differs from the manifest's (a damaged transfer: carry it again)")
    return problems


class JoinedParts:
    """The parts read one after the other as one binary stream, hashing what passes (the archive's sha256)."""

    def __init__(self, paths: list[Path]):
        self._paths: Iterator[Path] = iter(paths)
        self._file: BinaryIO | None = None
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        out = b""
        while n < 0 or len(out) < n:
            if self._file is None:
                path = next(self._paths, None)
                if path is None:
                    break
                self._file = path.open("rb")
            block = self._file.read(-1 if n < 0 else n - len(out))
            if not block:
                self._file.close()
                self._file = None
                continue
            out += block
        self.digest.update(out)
        return out

    def drain(self) -> None:
        while self.read(CHUNK):
            pass


def join(kit: Path, manifest: dict, out: Path) -> Path:
    """The parts joined into ``out``, checked against the manifest's archive sha256."""
    stream = JoinedParts([kit / p["name"] for p in manifest["parts"]])
    with out.open("wb") as f:
        while block := stream.read(CHUNK):
            f.write(block)
    if stream.digest.hexdigest() != manifest["archive"]["sha256"]:
        out.unlink()
        raise KitError(f"the joined parts' sha256 differs from {MANIFEST}'s archive sha256: pack the kit again")
    return out


def install(kit: Path, prefix: Path) -> bool:
    """Verify the parts and extract the joined archive into ``prefix`` (streamed: the joined archive is never
    written). A prefix already holding this archive (its stamp) is kept: returns False; else True."""
    manifest = load_manifest(kit)
    stamp = prefix / STAMP
    want = manifest["archive"]["sha256"]
    if stamp.is_file() and json.loads(stamp.read_text()).get("sha256") == want:
        return False
    problems = verify(kit, manifest)
    if problems:
        raise KitError("the kit's parts do not match its manifest:\n  " + "\n  ".join(problems))
    target = sys.version_info[:2]
    if manifest.get("python") and manifest["python"] != f"{target[0]}.{target[1]}":
        raise KitError(
            f"the kit was packed for Python {manifest['python']}, this interpreter is {target[0]}.{target[1]}: "
            f"pack with `bash scripts/gpu_kit.sh pack --python {target[0]}.{target[1]}` or run with PYTHON set"
        )
    if prefix.exists():
        shutil.rmtree(prefix)
    prefix.mkdir(parents=True)
    stream = JoinedParts([kit / p["name"] for p in manifest["parts"]])
    with tarfile.open(fileobj=stream, mode="r|xz") as tar:  # type: ignore[arg-type]
        # The "data" filter (3.12, and 3.11 from 3.11.4) refuses members that leave the prefix.
        tar.extractall(prefix, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    stream.drain()  # tar stops at its end-of-archive blocks; the hash covers every byte
    if stream.digest.hexdigest() != want:
        shutil.rmtree(prefix)
        raise KitError(f"the joined parts' sha256 differs from {MANIFEST}'s archive sha256: pack the kit again")
    stamp.write_text(json.dumps({"sha256": want, "packages": manifest.get("packages", {})}) + "\n")
    return True


# ------------------------------------------------------------------------------------------------------------- smoke

# What the product imports from the kit (one module per carried distribution it uses directly).
SMOKE_IMPORTS = (
    "ray",
    "verl",
    "hydra",
    "omegaconf",
    "diffusers",
    "peft",
    "rapidocr",
    "onnxruntime",
    "cv2",
    "Levenshtein",
    "fastapi",
    "uvicorn",
    "tensordict",
    "pyarrow.parquet",
    "matplotlib",
    "tensorboard",
    "pytest",
)


def smoke() -> dict[str, object]:
    """Import the product's dependencies and start a local Ray cluster with one actor (on a GPU when there is
    one): the trimmed Ray's GCS, raylet, agents and a worker process. Returns what the actor saw."""
    import importlib

    for name in SMOKE_IMPORTS:
        importlib.import_module(name)
    import ray
    import torch

    gpus = torch.cuda.device_count()

    @ray.remote(num_cpus=1, num_gpus=1 if gpus else 0)
    def probe() -> dict[str, object]:
        import torch

        from omni_async.cluster import configure_worker

        device = configure_worker()
        x = torch.ones(4, device=device)
        return {"device": device, "sum": float(x.sum()), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    from omni_async.cluster import init_ray, shutdown_ray

    init_ray(num_gpus=gpus)
    try:
        return ray.get(probe.remote(), timeout=300)
    finally:
        shutdown_ray()


# ---------------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_async.tools.gpu_kit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("packages", help="print name==version of every package the kit carries")
    p.add_argument("--lock", type=Path, required=True)
    p.add_argument("--python", default="3.12")
    p.add_argument("--have", type=Path, help="the target's `pip list --format=freeze`: carry only what it lacks")
    p = sub.add_parser("trim", help="remove what the product never imports from a staged folder")
    p.add_argument("stage", type=Path)
    p = sub.add_parser("seal", help="split a compressed archive into parts and write the manifest")
    p.add_argument("--archive", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--part-mib", type=float, default=PART_BYTES / 2**20)
    p.add_argument("--info", type=Path, help="a JSON object merged into the manifest")
    p = sub.add_parser("verify", help="check the parts against the manifest")
    p.add_argument("kit", type=Path)
    p = sub.add_parser("install", help="verify, join and extract the kit into a prefix")
    p.add_argument("kit", type=Path)
    p.add_argument("prefix", type=Path)
    sub.add_parser("smoke", help="import the product's dependencies, start Ray and one actor")
    args = parser.parse_args(argv)
    try:
        if args.command == "packages":
            have = read_have(args.have) if args.have else None
            for name, version in packages(args.lock, args.python, have).items():
                print(f"{name}=={version}")
        elif args.command == "trim":
            for path in trim(args.stage):
                print(f"trimmed {path}")
            for path in strip_symbols(args.stage):
                print(f"stripped {path}")
        elif args.command == "seal":
            info = json.loads(args.info.read_text()) if args.info else {}
            parts = split(args.archive, args.out, int(args.part_mib * 2**20))
            path = write_manifest(args.out, args.archive, parts, **info)
            manifest = json.loads(path.read_text())
            for part in manifest["parts"]:
                print(f"{part['name']}  {part['bytes'] / 2**20:.1f} MiB  {part['sha256'][:16]}")
        elif args.command == "verify":
            problems = verify(args.kit, load_manifest(args.kit))
            if problems:
                print("\n".join(problems), file=sys.stderr)
                return 1
            print(f"{args.kit}: every part matches {MANIFEST}")
        elif args.command == "smoke":
            print(json.dumps(smoke()))
        elif args.command == "install":
            fresh = install(args.kit, args.prefix)
            print(f"{'installed' if fresh else 'already installed'}: {args.prefix}")
    except KitError as e:
        print(f"gpu_kit: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
