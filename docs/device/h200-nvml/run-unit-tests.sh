#!/usr/bin/env bash
# The agent's unit tests on a machine with a real GPU (see README.md): the NVML
# paths that are skipped or take their no-driver branch elsewhere.
set -u
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi -L
.device/agent-unit-tests --test-threads 1 2>&1 | tee "$OUT/unit-tests.txt"
echo "unit tests rc=${PIPESTATUS[0]}"
.device/gpuhealth-agent --once >"$OUT/report.json" 2>"$OUT/report.stderr"; echo "once rc=$?"
cat "$OUT/report.stderr"
# What the kernel log holds about the GPU (the agent's kmsg backend reads this).
(timeout 3 cat /dev/kmsg 2>&1 | grep -a "NVRM" | tail -20) >"$OUT/kmsg-nvrm.txt"; echo "kmsg rc=$?"
wc -l "$OUT/kmsg-nvrm.txt"; head -5 "$OUT/kmsg-nvrm.txt"
