"""Wheels of the distributions installed in the running environment, for a fresh venv that must not use the network.

Each installed distribution is packed back into a wheel from the files its RECORD lists (compiled bytecode and
console scripts left out: pip writes those again), so `pip install --no-index --find-links` resolves a
requirements file against exactly the releases the test environment runs, in seconds.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import re
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What pip writes at install time rather than takes from a wheel.
INSTALL_FILES = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}


def requirements_closure(lines: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that `lines` (a requirements file's) need, with their extras, recursively."""
    wanted: dict[str, set[str]] = {}
    found: dict[str, metadata.Distribution] = {}
    stack = [(Requirement(line), {""}) for line in lines]
    while stack:
        req, extras = stack.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        if name in wanted and req.extras <= wanted[name]:
            continue
        try:
            found[name] = found.get(name) or metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # pip names what is missing when it resolves
        wanted[name] = wanted.get(name, set()) | req.extras
        stack.extend((Requirement(r), wanted[name] | {""}) for r in found[name].requires or [])
    return list(found.values())


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pack(dist: metadata.Distribution, folder: Path) -> Path:
    """`dist` as a wheel in `folder`, stored uncompressed (packing and unpacking are then disk copies)."""
    site = Path(dist.locate_file(""))
    info = next(site / f.parent for f in dist.files if f.name == "METADATA" and f.parent.suffix == ".dist-info")
    tags = [line.split(":", 1)[1].strip().split("-") for line in (info / "WHEEL").read_text().splitlines()
            if line.startswith("Tag:")]
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))  # e.g. py2.py3-none-any
    name, version = re.sub(r"[-_.]+", "_", dist.metadata["Name"]), dist.version
    scripts = {f"bin/{ep.name}" for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")}
    wheel = folder / f"{name}-{version}-{tag}.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as out:
        for entry in dist.files or []:
            path = entry.as_posix()
            if "__pycache__/" in path or (path.startswith(info.name + "/") and Path(path).name in INSTALL_FILES):
                continue
            source = site / entry
            if path.startswith("../"):  # outside site-packages: the venv's bin/, share/, include/
                inside = re.sub(r"^(\.\./)+", "", path)
                if inside in scripts or not source.is_file():
                    continue
                path = f"{name}-{version}.data/data/{inside}"
            elif not source.is_file():
                continue
            data = source.read_bytes()
            member = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            member.external_attr = (source.stat().st_mode & 0o777 | 0o100000) << 16
            out.writestr(member, data)
            record.append(f"{path},{_record_hash(data)},{len(data)}")
        record.append(f"{info.name}/RECORD,,")
        out.writestr(f"{info.name}/RECORD", "\n".join(record) + "\n")
    return wheel


def build(requirements: Path, folder: Path) -> Path:
    """A find-links folder holding a wheel of every installed distribution `requirements` needs."""
    folder.mkdir(parents=True, exist_ok=True)
    for dist in requirements_closure(requirement_lines(requirements)):
        pack(dist, folder)
    return folder
