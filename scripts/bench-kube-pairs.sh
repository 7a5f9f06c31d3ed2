#!/usr/bin/env bash
# The device-plugin path and the DRA path of `gpuplane bench kube`, back to back, in PAIRS pairs (default 3):
# one line per run, "path pods_bound_per_s scheduler_ms_per_pod api_server_ms_per_pod client_ms_per_pod", then
# the load average. docs/dra.md, "Throughput". Run it on a machine with nothing else running.
set -euo pipefail
pairs="${1:-3}"
for _ in $(seq 1 "$pairs"); do
  for path in plugin dra; do
    extra=()
    [ "$path" = dra ] && extra=(--dra)
    gpuplane bench kube --nodes 1000 --pods 3000 --repeats 1 --no-ceiling "${extra[@]}" --json 2>/dev/null |
      python3 -c "
import json, sys
run = json.load(sys.stdin)['figures'][0]['runs'][0]
print('$path', run['pods_bound_per_s'], run['scheduler_cpu_ms_per_pod'], run['api_server_cpu_ms_per_pod'],
      run['client_cpu_ms_per_pod'], flush=True)"
  done
done
uptime
