#!/usr/bin/env bash
# The agent's NVML thread on a real GPU: it reads every GPU, registers for
# XID events, lets go of every device node and takes them again, and
# `--once` matches nvidia-smi. Never resets or reboots anything. Run with
# the agent binary and its unit-test binary copied to .device/ (see
# README.md here); writes under $OUT.
set -u
uname -a; cat /etc/os-release 2>/dev/null | head -2
nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi-L.txt"
nvidia-smi --query-gpu=index,uuid,pci.bus_id,name --format=csv,noheader >"$OUT/nvidia-smi-gpus.csv" 2>&1
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
  ls "$d"/libnvidia-ml.so.1 2>/dev/null && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# The thread, XID event registration and release: the tests that take their
# no-driver branch everywhere else.
.device/agent-unit-tests --test-threads 1 --include-ignored nvml 2>&1 | tee "$OUT/unit-tests.txt"
echo "unit tests rc=${PIPESTATUS[0]}"
.device/gpuhealth-agent --once >"$OUT/report.json" 2>"$OUT/report.stderr"; echo "once rc=$?"
.device/gpuhealth-agent --once --readings >"$OUT/readings.json" 2>/dev/null; echo "readings rc=$?"
# Who holds the GPUs now, as a reset would see them.
for f in /proc/[0-9]*/fd/*; do
  t=$(readlink "$f" 2>/dev/null) && [[ "$t" == /dev/nvidia* ]] && echo "${f%/fd/*} $t"
done 2>/dev/null | sort -u >"$OUT/device-holders.txt"
cat "$OUT/report.stderr" "$OUT/unit-tests.txt" | tail -30
