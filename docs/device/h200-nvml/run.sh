#!/usr/bin/env bash
# One-shot check of the NVML backend on a real GPU (see README.md here).
set -u
uname -a; cat /etc/os-release 2>/dev/null | head -2
nvidia-smi -L 2>&1 | tee "$OUT/nvidia-smi-L.txt"
nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT >"$OUT/nvidia-smi-q.txt" 2>&1
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
  ls "$d"/libnvidia-ml.so* 2>/dev/null && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
.device/gpuhealth-agent --once >"$OUT/report.json" 2>"$OUT/report.stderr"; echo "report rc=$?"
.device/gpuhealth-agent --once --readings >"$OUT/readings.json" 2>"$OUT/readings.stderr"; echo "readings rc=$?"
env -u LD_LIBRARY_PATH LD_LIBRARY_PATH=/nonexistent .device/gpuhealth-agent --once --readings >/dev/null 2>"$OUT/no-nvml.stderr"; echo "no-nvml rc=$?"
cat "$OUT/report.stderr" "$OUT/report.json" "$OUT/readings.json" "$OUT/no-nvml.stderr"
