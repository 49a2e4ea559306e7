"""The GPU kit's own logic (``omni_async.tools.gpu_kit``): what it carries, trimming, parts of a bounded size with a
manifest, and an install that checks every part and the joined archive before it extracts anything it keeps."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from omni_async.tools import gpu_kit
from omni_async.tools.gpu_kit import KitError

ROOT = Path(__file__).resolve().parents[2]
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"


def make_kit(tmp_path: Path, part_bytes: int, python: str = PYTHON) -> tuple[Path, Path]:
    """A staged folder (a module, an executable, incompressible data) packed as the kit is: tar + xz, parts, manifest."""
    stage = tmp_path / "stage"
    (stage / "pkg").mkdir(parents=True)
    (stage / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    tool = stage / "pkg" / "server"
    tool.write_bytes(b"#!/bin/sh\necho hi\n")
    tool.chmod(0o755)
    (stage / "pkg" / "blob.bin").write_bytes(os.urandom(5000))  # xz cannot shrink it: several parts
    archive = tmp_path / gpu_kit.ARCHIVE
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(stage, arcname=".")
    kit = tmp_path / "kit"
    parts = gpu_kit.split(archive, kit, part_bytes)
    gpu_kit.write_manifest(kit, archive, parts, python=python, packages={"pkg": "1.0"})
    return stage, kit


def test_parts_are_bounded_and_install_restores_the_tree(tmp_path):
    stage, kit = make_kit(tmp_path, part_bytes=1500)
    manifest = json.loads((kit / gpu_kit.MANIFEST).read_text())
    archive = tmp_path / gpu_kit.ARCHIVE
    sizes = [p["bytes"] for p in manifest["parts"]]
    assert len(sizes) >= 4 and max(sizes) <= 1500 and sum(sizes) == archive.stat().st_size
    assert all(p["name"].startswith(f"{gpu_kit.ARCHIVE}.") for p in manifest["parts"])
    assert manifest["archive"]["sha256"] == gpu_kit.sha256_of(archive)
    assert gpu_kit.verify(kit, manifest) == []

    prefix = tmp_path / "prefix"
    assert gpu_kit.install(kit, prefix) is True
    for name in ("__init__.py", "server", "blob.bin"):
        assert (prefix / "pkg" / name).read_bytes() == (stage / "pkg" / name).read_bytes()
    assert os.access(prefix / "pkg" / "server", os.X_OK)  # Ray's gcs_server and raylet must stay executable
    assert json.loads((prefix / gpu_kit.STAMP).read_text())["packages"] == {"pkg": "1.0"}
    assert gpu_kit.install(kit, prefix) is False  # already installed: a second run keeps the prefix

    joined = gpu_kit.join(kit, manifest, tmp_path / "joined.tar.xz")
    assert joined.read_bytes() == archive.read_bytes()


def test_an_archive_smaller_than_a_part_is_one_part(tmp_path):
    archive = tmp_path / "a.tar.xz"
    archive.write_bytes(b"x" * 10)
    parts = gpu_kit.split(archive, tmp_path / "out", part_bytes=10)
    assert [(p.name, p.bytes) for p in parts] == [("a.tar.xz.000", 10)]


def test_missing_or_damaged_parts_are_named_before_anything_is_installed(tmp_path):
    _, kit = make_kit(tmp_path, part_bytes=1500)
    manifest = gpu_kit.load_manifest(kit)
    first, second = (kit / p["name"] for p in manifest["parts"][:2])
    second.unlink()
    damaged = bytearray(first.read_bytes())
    damaged[100] ^= 0xFF
    first.write_bytes(bytes(damaged))
    problems = gpu_kit.verify(kit, manifest)
    assert [p.split(":")[0] for p in problems] == [first.name, second.name]
    assert "sha256" in problems[0] and "missing" in problems[1]
    prefix = tmp_path / "prefix"
    with pytest.raises(KitError, match=second.name):
        gpu_kit.install(kit, prefix)
    assert not prefix.exists()
    assert gpu_kit.main(["verify", str(kit)]) == 1


def test_a_kit_for_another_python_is_refused_naming_the_fix(tmp_path):
    _, kit = make_kit(tmp_path, part_bytes=10**6, python="2.7")
    with pytest.raises(KitError, match=rf"packed for Python 2.7.*pack --python {PYTHON}"):
        gpu_kit.install(kit, tmp_path / "prefix")


def test_joined_parts_stream_reads_across_part_boundaries(tmp_path):
    paths = []
    for i, chunk in enumerate([b"abc", b"", b"defg", b"h"]):
        paths.append(tmp_path / f"p{i}")
        paths[-1].write_bytes(chunk)
    stream = gpu_kit.JoinedParts(paths)
    assert [stream.read(2) for _ in range(5)] == [b"ab", b"cd", b"ef", b"gh", b""]
    assert stream.digest.hexdigest() == gpu_kit.hashlib.sha256(b"abcdefgh").hexdigest()
    # tarfile's stream mode reads it as it reads a file
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        info = tarfile.TarInfo("f")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"xyz"))
    (tmp_path / "t").write_bytes(buf.getvalue())
    with tarfile.open(fileobj=gpu_kit.JoinedParts([tmp_path / "t"]), mode="r|xz") as tar:  # type: ignore[arg-type]
        assert [m.name for m in tar] == ["f"]


def test_trim_removes_what_the_product_never_imports(tmp_path):
    keep = ["ray/_private/worker.py", "ray/dashboard/agent.py", "pyarrow/_parquet.so", "pyarrow/libarrow.so.2600"]
    drop = ["ray/jars/ray.jar", "ray/rllib/x.py", "ray/dashboard/client/build/index.html", "pyarrow/_flight.so"]
    drop += ["pyarrow/libarrow_flight.so.2600", "pyarrow/tests/t.py", "cv2/__pycache__/x.pyc", "bin/ray"]
    for rel in keep + drop:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    removed = gpu_kit.trim(tmp_path)
    assert all((tmp_path / rel).exists() for rel in keep)
    assert not any((tmp_path / rel).exists() for rel in drop)
    assert {"ray/jars", "ray/rllib", "ray/dashboard/client", "pyarrow/_flight.so", "bin"} <= set(removed)


def test_the_kit_carries_what_the_image_lacks_at_the_locks_versions():
    lock = ROOT / "requirements" / "constraints-cpu.txt"
    carried = gpu_kit.packages(lock, "3.12")
    pins = gpu_kit.read_lock(lock)
    for name in ("ray", "verl", "hydra-core", "omegaconf", "diffusers", "peft", "rapidocr", "onnxruntime"):
        assert carried[name] == pins[name]
    for name in ("levenshtein", "fastapi", "uvicorn", "tensordict", "pyarrow", "opencv-python-headless", "pytest"):
        assert name in carried
    # the image's own packages and their dependencies, and what the product never imports, stay behind
    for name in ("torch", "transformers", "accelerate", "numpy", "safetensors", "huggingface-hub", *gpu_kit.DROP):
        assert name not in carried
    assert "omni-async" not in carried


def test_a_kit_packed_against_the_targets_list_carries_only_what_it_lacks(tmp_path):
    lock = ROOT / "requirements" / "constraints-cpu.txt"
    pins = gpu_kit.read_lock(lock)
    image = (ROOT / "requirements" / "cuda-image-packages.txt").read_text()
    have_file = tmp_path / "have.txt"
    # the workplace image's list plus pip freeze spellings (case, underscores), a bare name and an older peft
    have_file.write_text(image.replace("\npeft\n", "\npeft==0.1.0\n") + "Ray==2.60.0\nfastapi\nhydra_core==1.3.8\n")
    have = gpu_kit.read_have(have_file)
    assert have["ray"] == "2.60.0" and have["fastapi"] is None and have["hydra-core"] == "1.3.8"
    carried = gpu_kit.packages(lock, "3.12", have)
    # what the target has stays behind, whatever its version (the image's pyarrow and opencv are used)
    for name in ("ray", "fastapi", "pyarrow", "hydra-core", "opencv-python-headless", "torch", "numpy"):
        assert name not in carried
    # peft must match the lock: carried when the target's version differs
    assert carried["peft"] == pins["peft"]
    # what it lacks comes at the lock's version (pydantic: the image's transformers does not bring it; fastapi's
    # opentelemetry-api, which the H200 run found missing when Ray's extra was dropped by name)
    for name in ("verl", "diffusers", "rapidocr", "omegaconf", "pydantic", "opentelemetry-api"):
        assert carried[name] == pins[name]
    # Ray's default extra (dashboard, metrics agents) is not followed
    for name in ("opencensus", "aiohttp-cors", "colorful", "py-spy", "opentelemetry-exporter-prometheus"):
        assert name not in carried
    assert "peft" not in gpu_kit.packages(lock, "3.12", {**have, "peft": pins["peft"]})
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(KitError, match="pip list --format=freeze"):
        gpu_kit.read_have(tmp_path / "empty.txt")
