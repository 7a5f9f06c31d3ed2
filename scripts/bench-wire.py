"""Client CPU per write of RestKubeApi's write path: 1,000 merge PATCHes of one pod's annotations against the
local API server in its own process, five times; prints the median and each run (ms of this process's CPU)."""

from __future__ import annotations

import statistics
import time

from gpuplane.kube.api import RestKubeApi
from gpuplane.sim.kube_bench import ServerProcess

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"},
       "spec": {"containers": [{"name": "c", "image": "x"}]}}


def main() -> None:
    server = ServerProcess(10)
    api = RestKubeApi.from_url(server.url)
    try:
        api.create("/api/v1/namespaces/default/pods", POD)
        runs = []
        for _ in range(5):
            started = time.process_time()
            for i in range(1000):
                api.patch("/api/v1/namespaces/default/pods/p", {"metadata": {"annotations": {"k": str(i)}}})
            runs.append((time.process_time() - started) / 1000 * 1e3)
        print(f"client CPU per write: median {statistics.median(runs):.4f} ms; runs {[round(r, 4) for r in runs]}")
    finally:
        api.close()
        server.close()


if __name__ == "__main__":
    main()
