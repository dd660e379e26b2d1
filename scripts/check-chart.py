#!/usr/bin/env python3
"""One install, two renderings: the chart (charts/gpuhealth) and the
kustomize install (config/) must be the same objects. Run by `make lint`.

Renders the chart with `helm template` and config/ with `kubectl
kustomize`, parses both, and compares every object, keyed by kind,
namespace and name, field by field. Only the differences listed in
ALLOWED may stand; anything else fails, naming the object and the field:

- the chart at its defaults against config/default;
- the chart with `agent.nvml.source=driverRoot` against the agents of
  config/agent/driver-root;
- the chart's PrometheusRule (monitoring.prometheusRule.enabled) against
  config/monitoring.

It checks that a wrong value is refused by values.schema.json, naming
it, and that Chart.yaml's version and appVersion are the workspace's
(Cargo.toml). Then it renders the chart with every other value that changes what it
renders, so that no branch of a template is left unrendered. Helm comes
from scripts/helm.sh, kubectl from the test cluster's cache
(e2e/cluster/build.sh). Python 3 and PyYAML.
"""

import functools
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpuhealth"
NAMESPACE = "gpuhealth-system"

# The labels Helm's release adds to every object it owns.
RELEASE_LABELS = {
    "helm.sh/chart",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/version",
}
# What the chart sets that kustomize leaves to the API server's default
# (the same value), as (kind, dotted path with [] for every list item).
ALLOWED = {
    ("Deployment", "spec.template.spec.containers[].imagePullPolicy"),
    ("DaemonSet", "spec.template.spec.containers[].imagePullPolicy"),
}
# Lists whose order means nothing, compared item by item under their key
# (kustomize's patches put the items they add first).
LIST_KEYS = {"containers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
# CEL is compared with its whitespace collapsed: kustomize's YAML reader
# reads a line break before a more-indented line of a folded scalar (`>-`)
# as two, Helm's as one; CEL does not tell them apart.
CEL_KEYS = {"expression", "messageExpression"}
# Objects only kustomize installs: the release's namespace is Helm's to
# create (`--create-namespace`), not the chart's.
ONLY_KUSTOMIZE = {("Namespace", "", NAMESPACE)}


def run(*cmd):
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return done.stdout


@functools.cache
def helm_binary():
    return run(str(ROOT / "scripts" / "helm.sh")).strip()


@functools.cache
def kubectl_binary():
    return str(Path(run(str(ROOT / "e2e" / "cluster" / "build.sh")).strip()) / "kubectl")


def helm(*values, crds=False):
    cmd = [helm_binary(), "template", "gpuhealth", str(CHART), "--namespace", NAMESPACE]
    if crds:
        cmd.append("--include-crds")
    for value in values:
        cmd += ["--set", value]
    return objects(run(*cmd), release=True)


def kustomize(path):
    return objects(run(kubectl_binary(), "kustomize", str(ROOT / path)), release=False)


def objects(text, release):
    found = {}
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        metadata = doc.get("metadata", {})
        if release:
            labels = metadata.get("labels") or {}
            missing = RELEASE_LABELS - labels.keys()
            if missing and doc["kind"] != "CustomResourceDefinition":
                sys.exit(f"chart: {doc['kind']} {metadata.get('name')} lacks {sorted(missing)}")
            for label in RELEASE_LABELS:
                labels.pop(label, None)
            if not labels:
                metadata.pop("labels", None)
        key = (doc["kind"], metadata.get("namespace", ""), metadata["name"])
        if key in found:
            sys.exit(f"{key} rendered twice")
        found[key] = doc
    return found


def allowed(kind, path):
    return (kind, re.sub(r"\[[^]]*\]", "[]", path)) in ALLOWED


def differences(kind, chart, kustomized, path=""):
    """Dotted paths where the two differ, those ALLOWED left out."""
    if allowed(kind, path):
        return []
    if isinstance(chart, dict) and isinstance(kustomized, dict):
        out = []
        for key in sorted(chart.keys() | kustomized.keys()):
            child = f"{path}.{key}" if path else key
            if key not in chart or key not in kustomized:
                if not allowed(kind, child):
                    out.append(f"{child}: only in {'the chart' if key in chart else 'kustomize'}")
                continue
            out += differences(kind, chart[key], kustomized[key], child)
        return out
    field = path.rsplit(".", 1)[-1].removesuffix("[]")
    if field in LIST_KEYS and isinstance(chart, list) and isinstance(kustomized, list):
        key = LIST_KEYS[field]
        ours, theirs = ({i.get(key): i for i in items} for items in (chart, kustomized))
        # Two items under one key would hide one of them.
        out = [f"{path}: two items with one {key}" for items, keyed in ((chart, ours), (kustomized, theirs)) if len(keyed) != len(items)]
        for item in sorted(ours.keys() | theirs.keys(), key=str):
            if item not in ours or item not in theirs:
                out.append(f"{path}[{item}]: only in {'the chart' if item in ours else 'kustomize'}")
            else:
                out += differences(kind, ours[item], theirs[item], f"{path}[{item}]")
        return out
    if field in CEL_KEYS and isinstance(chart, str) and isinstance(kustomized, str):
        return [] if chart.split() == kustomized.split() else [f"{path}: chart {chart!r}, kustomize {kustomized!r}"]
    if isinstance(chart, list) and isinstance(kustomized, list) and len(chart) == len(kustomized):
        out = []
        for a, b in zip(chart, kustomized):
            out += differences(kind, a, b, f"{path}[]")
        return out
    return [] if chart == kustomized else [f"{path}: chart {chart!r}, kustomize {kustomized!r}"]


def compare(what, chart, kustomized, only_kustomize=frozenset()):
    problems = []
    for key in sorted(chart.keys() | kustomized.keys()):
        if key not in chart:
            if key not in only_kustomize:
                problems.append(f"{key}: kustomize installs it, the chart does not")
        elif key not in kustomized:
            problems.append(f"{key}: the chart installs it, kustomize does not")
        else:
            problems += [f"{key} {d}" for d in differences(key[0], chart[key], kustomized[key])]
    for problem in problems:
        print(f"check-chart: {what}: {problem}")
    return not problems


def daemonsets(objs):
    return {k: v for k, v in objs.items() if k[0] == "DaemonSet"}


def versions_agree():
    """The chart repeats the workspace's version, the one place it lives."""
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    if chart["version"] != version or str(chart["appVersion"]) != version:
        print(
            f"check-chart: Chart.yaml says version {chart['version']}, appVersion {chart['appVersion']};"
            f" the workspace is {version} (make set-version VERSION={version})"
        )
        return False
    return True


def main():
    ok = versions_agree()
    ok &= compare("defaults against config/default", helm(crds=True), kustomize("config/default"), ONLY_KUSTOMIZE)
    ok &= compare(
        "agent.nvml.source=driverRoot against config/agent/driver-root",
        daemonsets(helm("agent.nvml.source=driverRoot")),
        daemonsets(kustomize("config/agent/driver-root")),
    )
    rule = {k: v for k, v in helm("monitoring.prometheusRule.enabled=true").items() if k[0] == "PrometheusRule"}
    ok &= compare("the PrometheusRule against config/monitoring", rule, kustomize("config/monitoring"))
    # A wrong value is refused by the schema, naming it.
    for value, named in (
        ("agent.rebootMethod=reboot", "/agent/rebootMethod"),
        ("operator.replica=3", "'replica' not allowed"),
        ("agent.image.digest=latest", "/agent/image/digest"),
        # Written into an admission policy's CEL string: a quote would end it.
        ("operator.guardrails.conditionTypes={A'B}", "/operator/guardrails/conditionTypes/0"),
        ("agent.executorAppArmorProfile.type=Bogus", "/agent/executorAppArmorProfile/type"),
    ):
        done = subprocess.run(
            [helm_binary(), "template", "gpuhealth", str(CHART), "--set", value], capture_output=True, text=True
        )
        if done.returncode == 0 or named not in done.stderr:
            print(f"check-chart: --set {value} was not refused naming {named!r}: {done.stderr.strip()}")
            ok = False
    # Every other branch renders (the schema and the templates agree).
    for values in (
        ["admission.enabled=false", "rbac.forceDelete=true"],
        ["agent.rebootMethod=kured", "agent.diagnostics.dcgmi=/opt/dcgm/bin/dcgmi"],
        ["agent.diagnostics.hostEngine=$(HOST_IP):5555"],
        ["agent.rebootMethod=none", "operator.guardrails.conditionTypes={SysLogsXIDError}"],
        ["monitoring.serviceMonitor.enabled=true", "monitoring.dashboard.enabled=true"],
        ["agent.image.digest=sha256:" + "0" * 64, "operator.extraArgs={--pause-operands=x}"],
        [
            "agent.executorAppArmorProfile.type=Localhost",
            "agent.executorAppArmorProfile.localhostProfile=gpuhealth-executor",
            "agent.executorSeLinuxOptions=null",
        ],
    ):
        helm(*values)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
