#!/usr/bin/env python3
"""Builds the images the Dockerfiles describe, without a container engine or
a registry: `make images`.

Each Dockerfile's last stage says what its image is (the distroless base, the
binary it copies from the build stage, the user, the ports, the entry point).
This reads that stage and builds the same image from what this machine has:
the base from Debian's packages (`apt-get download`, `dpkg-deb -x`: the glibc
and CA certificates distroless/cc carries, and its root and nonroot users),
the binary from a release build of the workspace. Each image is written as an
OCI image layout in a tar archive (what `ctr images import` takes), named as
the manifests in config/ name it, with its manifest digest beside it.

Our own packer rather than umoci or go-containerregistry: an OCI layout is
three JSON documents and two gzipped tars, which the standard library writes
byte for byte the same on every run (sorted entries, fixed times and owners),
so an unchanged binary keeps its digest; and nothing more is built or cached.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

REPOSITORY = "ghcr.io/gpuhealth"
# The Debian packages behind distroless/cc, less what our binaries never load
# (libstdc++, libgomp, tzdata: jiff bundles its time zones).
BASE_PACKAGES = ["libc6", "libgcc-s1", "ca-certificates"]
# Of those packages, only what runs a binary: no docs, no scripts, no locale
# converters.
DROPPED = re.compile(
    r"^(usr/share/(doc|lintian|man|locale|ca-certificates)|usr/sbin|usr/bin|sbin|bin"
    r"|etc/ca-certificates|usr/lib/x86_64-linux-gnu/gconv|usr/lib/x86_64-linux-gnu/audit)(/|$)"
)
PASSWD = "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = "root:x:0:\nnonroot:x:65532:\n"
# Every file's time in the layers: the same bytes on every run.
EPOCH = 0


def fail(message):
    print(f"[images] {message}", file=sys.stderr)
    sys.exit(1)


def last_stage(dockerfile):
    """The runtime stage of a Dockerfile: its base, the binary it copies from
    the build stage, user, ports and entry point."""
    lines = [line.strip() for line in dockerfile.read_text().splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    starts = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")]
    if not starts:
        fail(f"{dockerfile}: no FROM")
    stage = {"base": lines[starts[-1]].split()[1], "user": "0:0", "ports": [], "entrypoint": None}
    for line in lines[starts[-1] + 1 :]:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "COPY" and rest.startswith("--from="):
            _, source, dest = rest.split()
            stage["binary"] = Path(source).name
            stage["dest"] = dest
        elif word == "USER":
            stage["user"] = rest.strip()
        elif word == "EXPOSE":
            stage["ports"] += rest.split()
        elif word == "ENTRYPOINT":
            stage["entrypoint"] = json.loads(rest)
        else:
            fail(f"{dockerfile}: the packer does not know `{line}` in the last stage")
    if not stage["base"].startswith("gcr.io/distroless/cc-debian12"):
        fail(f"{dockerfile}: base {stage['base']}: the packer assembles distroless/cc-debian12 only")
    if "binary" not in stage or not stage["entrypoint"]:
        fail(f"{dockerfile}: the last stage copies no binary or has no ENTRYPOINT")
    return stage


def debs(cache):
    """The base packages' .deb files, downloaded once into `cache`."""
    cache.mkdir(parents=True, exist_ok=True)
    found = {}
    for package in BASE_PACKAGES:
        hits = sorted(cache.glob(f"{package}_*.deb"))
        if not hits:
            download = ["apt-get", "download", package]
            if subprocess.run(download, cwd=cache, capture_output=True).returncode != 0:
                # A fresh machine has no package lists yet.
                subprocess.run(["apt-get", "update", "-qq"], check=True)
                subprocess.run(download, cwd=cache, check=True)
            hits = sorted(cache.glob(f"{package}_*.deb"))
        if not hits:
            fail(f"apt-get download {package} left no .deb in {cache}")
        found[package] = hits[-1]
    return found


def base_files(cache):
    """The base's files: path -> (TarInfo, bytes or None), from the packages
    extracted into a scratch directory, and the users and CA bundle made the
    way the packages' scripts would make them."""
    root = cache / "root"
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    for deb in debs(cache).values():
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if DROPPED.match(rel):
            continue
        info = tarfile.TarInfo(rel)
        st = path.lstat()
        info.mode = st.st_mode & 0o7777
        if path.is_symlink():
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
            files[rel] = (info, None)
        elif path.is_dir():
            info.type = tarfile.DIRTYPE
            files[rel] = (info, None)
        else:
            files[rel] = (info, path.read_bytes())
    certs = sorted((root / "usr/share/ca-certificates/mozilla").glob("*.crt"))
    if not certs:
        fail("ca-certificates has no certificates")
    bundle = b"".join(c.read_bytes().rstrip(b"\n") + b"\n" for c in certs)
    # /var/run is where programs look for sockets the runtime mounts under
    # /run (nvidia-smi for nvidia-persistenced's): the link base-files makes.
    link = tarfile.TarInfo("var/run")
    link.type, link.linkname, link.mode = tarfile.SYMTYPE, "/run", 0o777
    files["var/run"] = (link, None)
    for d in ["etc", "etc/ssl", "etc/ssl/certs", "tmp", "root", "home", "home/nonroot", "run", "var"]:
        info = tarfile.TarInfo(d)
        info.type = tarfile.DIRTYPE
        info.mode = {"tmp": 0o1777, "root": 0o700, "home/nonroot": 0o700}.get(d, 0o755)
        if d == "home/nonroot":
            info.uid = info.gid = 65532
        files[d] = (info, None)
    for name, data in [
        ("etc/ssl/certs/ca-certificates.crt", bundle),
        ("etc/passwd", PASSWD.encode()),
        ("etc/group", GROUP.encode()),
    ]:
        info = tarfile.TarInfo(name)
        info.mode = 0o644
        files[name] = (info, data)
    return files


def layer(files):
    """A gzipped tar of `files` and its digests: (blob, diff_id)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info, data = files[name]
            info.mtime = EPOCH
            info.uname = info.gname = ""
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    tarred = raw.getvalue()
    return gzip.compress(tarred, compresslevel=6, mtime=EPOCH), "sha256:" + hashlib.sha256(tarred).hexdigest()


def blob(blobs, data, media_type):
    digest = hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def image(stage, base, bin_dir, repository, version):
    """The OCI layout of one image: (files of the archive, name, digest)."""
    binary = bin_dir / stage["binary"]
    if not binary.is_file():
        fail(f"no {binary}: build it first (cargo build --release)")
    info = tarfile.TarInfo(stage["dest"].lstrip("/"))
    info.mode = 0o755
    app = {info.name: (info, binary.read_bytes())}
    blobs = {}
    layers, diff_ids = [], []
    for files in (base, app):
        gz, diff_id = layer(files)
        layers.append(blob(blobs, gz, "application/vnd.oci.image.layer.v1.tar+gzip"))
        diff_ids.append(diff_id)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": stage["user"],
            "Entrypoint": stage["entrypoint"],
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"],
            "ExposedPorts": {f"{p}/tcp" if "/" not in p else p: {} for p in stage["ports"]},
            # The version the workspace gives every artifact of a release.
            "Labels": {
                "org.opencontainers.image.title": stage["binary"],
                "org.opencontainers.image.version": version,
            },
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    config_desc = blob(
        blobs, json.dumps(config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json"
    )
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": layers,
    }
    manifest_desc = blob(blobs, json.dumps(manifest, sort_keys=True).encode(), manifest["mediaType"])
    name = f"{repository}/{stage['binary']}:{version}"
    manifest_desc["annotations"] = {
        "org.opencontainers.image.ref.name": version,
        "io.containerd.image.name": name,
    }
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [manifest_desc]}
    layout = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index, sort_keys=True).encode(),
    }
    for digest, data in blobs.items():
        layout[f"blobs/sha256/{digest}"] = data
    return layout, name, manifest_desc["digest"]


def write_archive(path, layout):
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ["blobs", "blobs/sha256"]:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
            tar.addfile(info)
        for name in sorted(layout):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(layout[name]), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(layout[name]))


# Where anything in an image may be: the C library and its loader, the
# users, the CA bundle, the empty homes and /tmp, and the binary.
ALLOWED = re.compile(r"^(lib|lib64|usr|usr/lib|usr/share|etc|etc/ssl|etc/ssl/certs|etc/ld\.so\.conf\.d|tmp|root|home|home/nonroot|run|var|var/run"
                     r"|(usr/)?lib(64)?/(x86_64-linux-gnu/)?[^/]+\.so[.0-9]*|usr/lib/x86_64-linux-gnu|lib/x86_64-linux-gnu"
                     r"|etc/(passwd|group|ld\.so\.conf\.d/[^/]+|ssl/certs/ca-certificates\.crt))$")


def check(archive, stage):
    """What the archive holds, read back: the binary where the entry point
    runs it, the user it runs as, the CA bundle, and nothing else."""
    with tarfile.open(archive) as outer:
        read = lambda name: outer.extractfile(name).read()
        index = json.loads(read("index.json"))
        blob = lambda d: read(f"blobs/sha256/{d.split(':')[1]}")
        manifest = json.loads(blob(index["manifests"][0]["digest"]))
        config = json.loads(blob(manifest["config"]["digest"]))
        files = {}
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"]))) as tar:
                for member in tar.getmembers():
                    files[member.name] = tar.extractfile(member).read() if member.isfile() else b""
    binary = stage["dest"].lstrip("/")
    stray = sorted(n for n in files if n != binary and not ALLOWED.match(n))
    problems = []
    if stray:
        problems.append(f"files beyond the binary, glibc, users and CA bundle: {stray[:5]}")
    if config["config"]["Entrypoint"][0].lstrip("/") != binary or not files.get(binary):
        problems.append(f"the entry point {config['config']['Entrypoint']} is not the binary {binary}")
    if b"BEGIN CERTIFICATE" not in files.get("etc/ssl/certs/ca-certificates.crt", b""):
        problems.append("no CA bundle")
    uid = config["config"]["User"].split(":")[0]
    if not any(line.split(":")[2] == uid for line in files.get("etc/passwd", b"").decode().splitlines()):
        problems.append(f"user {uid} is not in /etc/passwd")
    if problems:
        fail(f"{archive}: " + "; ".join(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dockerfiles", nargs="+", type=Path)
    parser.add_argument("--bin-dir", type=Path, required=True, help="where the release binaries are")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/gpuhealth/images")
    parser.add_argument("--repository", default=REPOSITORY, help="where the images' names start")
    parser.add_argument("--tag", help="the images' tag (default: the workspace's version)")
    args = parser.parse_args()
    repo = Path(__file__).resolve().parent.parent
    version = args.tag or tomllib.loads((repo / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    base = base_files(args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    for dockerfile in args.dockerfiles:
        stage = last_stage(dockerfile)
        layout, name, digest = image(stage, base, args.bin_dir, args.repository, version)
        archive = args.out / f"{stage['binary']}.oci.tar"
        write_archive(archive, layout)
        check(archive, stage)
        # What a manifest names to run exactly this image.
        (args.out / f"{stage['binary']}.ref").write_text(f"{name}@{digest}\n")
        print(f"[images] {archive}: {name}@{digest}")


if __name__ == "__main__":
    main()
