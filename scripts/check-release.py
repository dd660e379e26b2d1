#!/usr/bin/env python3
"""Checks a release's artifacts (scripts/release.sh) against one another:
every one carries the version, the krew manifest's sha256 are the
archives', each image's reference names the digest of the archive beside
it, the chart is whole (its CRDs and the files it reads from config/ inside
the package, not links), and SHA256SUMS holds. Fails naming what is wrong.
Usage: check-release.py DIR VERSION. Python 3 and PyYAML."""

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import yaml

problems = []


def expect(ok, message):
    if not ok:
        problems.append(message)


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_images(out, version):
    archives = sorted((out / "images").glob("*.oci.tar"))
    expect(len(archives) == 3, f"three image archives, found {[a.name for a in archives]}")
    for archive in archives:
        with tarfile.open(archive) as tar:
            blob = lambda digest: tar.extractfile(f"blobs/sha256/{digest.split(':')[1]}").read()
            index = json.loads(tar.extractfile("index.json").read())
            manifest_digest = index["manifests"][0]["digest"]
            manifest = json.loads(blob(manifest_digest))
            config = json.loads(blob(manifest["config"]["digest"]))
        labels = config["config"].get("Labels", {})
        expect(labels.get("org.opencontainers.image.version") == version, f"{archive.name}: labels {labels}")
        ref = archive.with_name(archive.name.replace(".oci.tar", ".ref")).read_text().strip()
        expect(ref.endswith(f":{version}@{manifest_digest}"), f"{archive.name}: {ref} is not :{version}@{manifest_digest}")


def check_chart(out, version):
    package = out / f"gpuhealth-{version}.tgz"
    expect(package.is_file(), f"no {package.name}")
    if not package.is_file():
        return
    with tarfile.open(package) as tar:
        names = set(tar.getnames())
        chart = yaml.safe_load(tar.extractfile("gpuhealth/Chart.yaml").read())
        links = [m.name for m in tar.getmembers() if m.issym() or m.islnk()]
    expect(chart["version"] == version and str(chart["appVersion"]) == version, f"Chart.yaml {chart}")
    expect(not links, f"links in the chart package: {links}")
    for needed in (
        "gpuhealth/values.schema.json",
        "gpuhealth/crds/gpuhealth.io_gpuhealthpolicies.yaml",
        "gpuhealth/files/admission/operator-keys.yaml",
        "gpuhealth/files/agent/base/admission-policy.yaml",
        "gpuhealth/files/monitoring/dashboard.json",
    ):
        expect(needed in names, f"the chart package lacks {needed}")


def check_plugin(out, version):
    manifest = yaml.safe_load((out / "plugin" / "gpuhealth.yaml").read_text())
    expect(manifest["spec"]["version"] == f"v{version}", f"krew version {manifest['spec']['version']}")
    platforms = manifest["spec"]["platforms"]
    expect(platforms, "the krew manifest names no platform")
    for platform in platforms:
        archive = out / "plugin" / platform["uri"].rsplit("/", 1)[1]
        expect(archive.is_file(), f"no {archive.name}")
        if archive.is_file():
            expect(sha256(archive) == platform["sha256"], f"{archive.name}: sha256 is not the manifest's")
            with tarfile.open(archive) as tar:
                expect(tar.getnames() == ["kubectl-gpuhealth"], f"{archive.name}: {tar.getnames()}")


def check_sums(out):
    for line in (out / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        expect(sha256(out / name) == digest, f"SHA256SUMS: {name}")


def main():
    out, version = Path(sys.argv[1]), sys.argv[2]
    check_images(out, version)
    check_chart(out, version)
    check_plugin(out, version)
    expect(len(list((out / "crds").glob("*.yaml"))) == 2, "two CRDs")
    notes = (out / "RELEASE-NOTES.md").read_text()
    expect(notes.startswith(f"# gpuhealth {version}\n"), "release notes heading")
    check_sums(out)
    for problem in problems:
        print(f"check-release: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
