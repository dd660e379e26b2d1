#!/usr/bin/env python3
"""`make set-version VERSION=x.y.z`: sets gpuhealth's version where it lives,
the workspace's Cargo.toml, and where the chart must repeat it (Chart.yaml's
version and appVersion, which `make lint` checks against it), then the
chart's README. Python 3 standard library only."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def replace(path, pattern, new):
    text = path.read_text()
    changed, count = re.subn(pattern, new, text, count=1, flags=re.M)
    if count != 1:
        sys.exit(f"set-version: no {pattern!r} in {path}")
    path.write_text(changed)


def main():
    if len(sys.argv) != 2 or not re.fullmatch(r"\d+\.\d+\.\d+(-[0-9A-Za-z.]+)?", sys.argv[1].lstrip("v")):
        sys.exit("usage: make set-version VERSION=x.y.z")
    version = sys.argv[1].lstrip("v")
    replace(ROOT / "Cargo.toml", r'(\[workspace\.package\]\n(?:.*\n)*?version = )"[^"]*"', rf'\g<1>"{version}"')
    chart = ROOT / "charts" / "gpuhealth" / "Chart.yaml"
    replace(chart, r"^version: .*$", f"version: {version}")
    replace(chart, r"^appVersion: .*$", f'appVersion: "{version}"')
    subprocess.run([sys.executable, str(ROOT / "scripts" / "chart-readme.py")], check=True)
    print(f"gpuhealth is {version}: Cargo.toml and charts/gpuhealth; commit them (Cargo.lock follows on the next build)")


if __name__ == "__main__":
    main()
