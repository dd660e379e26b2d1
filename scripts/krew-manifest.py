#!/usr/bin/env python3
"""Prints the krew plugin manifest for the kubectl plugin's archives a
release built (scripts/release.sh): one platform per `os/arch=archive`
argument, each with the archive's sha256 and its address among the
release's downloads. Python 3 standard library only."""

import argparse
import hashlib
import json
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", required=True)
    parser.add_argument("--dir", type=Path, required=True, help="where the archives are")
    parser.add_argument("platforms", nargs="*", help="os/arch=archive")
    args = parser.parse_args()
    home = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["repository"]
    tag = f"v{args.version}"
    platforms = []
    for platform in args.platforms:
        os_arch, archive = platform.split("=", 1)
        os_name, arch = os_arch.split("/")
        digest = hashlib.sha256((args.dir / archive).read_bytes()).hexdigest()
        platforms.append(
            {
                "selector": {"matchLabels": {"os": os_name, "arch": arch}},
                "uri": f"{home}/releases/download/{tag}/{archive}",
                "sha256": digest,
                "bin": "kubectl-gpuhealth",
            }
        )
    manifest = {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "gpuhealth"},
        "spec": {
            "version": tag,
            "homepage": home,
            "shortDescription": "See and explain what gpuhealth does to your GPU nodes",
            "description": (
                "Shows the fleet's GPU health (status), why a node is where it is and what "
                "comes next (explain), and the history of its incidents, from gpuhealth's "
                "GpuNodeHealth objects and Events."
            ),
            "platforms": platforms,
        },
    }
    # JSON is YAML: krew reads it as it is.
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    main()
