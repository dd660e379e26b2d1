#!/usr/bin/env bash
# The shipped agent image on a machine with a real GPU, read-only: the image
# `make images` builds (target/images/gpuhealth-agent.oci.tar, copied to
# .device/), its layers unpacked into a root as a runtime would, the
# driver's files given to it the way the NVIDIA Container Toolkit gives them
# (`nvidia-container-cli` where the toolkit is installed; otherwise the
# host's libnvidia-ml.so.1, nvidia-smi and /dev/nvidia* bind-mounted, as
# the toolkit's CDI spec mounts them), then `gpuhealth-agent --once` run in
# it with the shipped capabilities only. Never resets or reboots anything:
# --once reads NVML and checks that nvidia-smi runs (`-h`). Writes under $OUT.
set -u
archive=.device/gpuhealth-agent.oci.tar
[[ -f $archive ]] || { echo "no $archive: copy target/images/gpuhealth-agent.oci.tar there" >&2; exit 2; }
nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi-L.txt"
work=$(mktemp -d)
root=$work/root
mkdir -p "$root" "$work/oci"
tar -xf "$archive" -C "$work/oci"
# The manifest the index names, then its layers in order.
python3 - "$work/oci" "$root" <<'PY'
import json, subprocess, sys
oci, root = sys.argv[1], sys.argv[2]
blob = lambda d: f"{oci}/blobs/sha256/{d.split(':')[1]}"
index = json.load(open(f"{oci}/index.json"))
manifest = json.load(open(blob(index["manifests"][0]["digest"])))
for layer in manifest["layers"]:
    subprocess.run(["tar", "-xzf", blob(layer["digest"]), "-C", root], check=True)
print(index["manifests"][0]["annotations"]["io.containerd.image.name"], index["manifests"][0]["digest"])
PY
run_in_root() { # how (for the record), then the agent's arguments
  local how=$1
  shift
  unshare --mount --fork bash -c '
    set -e
    root=$1 how=$2
    shift 2
    mount --make-rprivate /
    mkdir -p "$root/proc" "$root/dev" "$root/usr/bin" "$root/usr/lib/x86_64-linux-gnu"
    mount -t proc proc "$root/proc"
    mount -t tmpfs dev "$root/dev"
    if [[ $how == nvidia-container-cli ]]; then
      nvidia-container-cli --load-kmods configure --no-cgroups --utility --device=all --pid=$$ "$root"
    else
      for d in /dev/nvidia*; do
        [[ -c $d ]] || continue
        touch "$root$d"
        mount --bind "$d" "$root$d"
      done
      lib=$(ldconfig -p | awk "/libnvidia-ml.so.1 .*x86-64/ {print \$NF; exit}")
      touch "$root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" "$root/usr/bin/nvidia-smi"
      mount --bind "$lib" "$root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
      mount --bind "$(command -v nvidia-smi)" "$root/usr/bin/nvidia-smi"
    fi
    # Into the root, then down to what the shipped DaemonSet adds back
    # after dropping every capability (chroot itself needs one it drops),
    # no new privileges, and the image'"'"'s entrypoint.
    exec python3 - "$root" "$@" <<"PY"
import ctypes, os, sys
root, args = sys.argv[1], sys.argv[2:]
# CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_SYS_BOOT, CAP_SYSLOG
keep = {2, 19, 21, 22, 34}
libc = ctypes.CDLL(None, use_errno=True)
last = int(open("/proc/sys/kernel/cap_last_cap").read())
os.chroot(root)
os.chdir("/")
for cap in range(last + 1):
    if cap not in keep and libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        raise OSError(ctypes.get_errno(), f"dropping capability {cap}")
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
os.execv("/gpuhealth-agent", ["/gpuhealth-agent", *args])
PY
  ' run "$root" "$how" "$@"
}
how=bind-mounts
command -v nvidia-container-cli >/dev/null && how=nvidia-container-cli
echo "driver files given by: $how" | tee "$OUT/how.txt"
run_in_root "$how" --once --reboot-method=none >"$OUT/report.json" 2>"$OUT/report.stderr"; echo "once rc=$?"
run_in_root "$how" --once --readings >"$OUT/readings.json" 2>/dev/null; echo "readings rc=$?"
cat "$OUT/report.stderr"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print("capabilities", r.get("capabilities")); print(len(r["gpus"]), "GPU(s)")' "$OUT/report.json" 2>/dev/null ||
  echo "no report: report.stderr says why"
rm -rf "$work"
