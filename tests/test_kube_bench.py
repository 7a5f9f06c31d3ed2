"""`gpuplane bench kube` on a tiny cluster: every pod bound, the writes per pod and the reads counted by the API
server itself; and the counting it relies on."""

from __future__ import annotations

from gpuplane.kube.api import pod_path
from gpuplane.kube.localapi import FakeApiServer, node_json, pod_json
from gpuplane.sim import kube_bench


def test_the_api_server_counts_requests_by_verb_and_resource() -> None:
    with FakeApiServer(keep_requests=False) as server:
        server.add_node(node_json("n1"))
        api = server.api
        api.create(pod_path("ns"), pod_json("p", namespace="ns"))
        api.patch(pod_path("ns", "p"), {"metadata": {"annotations": {"a": "b"}}})
        api.create(pod_path("ns", "p", "binding"), {"apiVersion": "v1", "kind": "Binding",
                                                    "metadata": {"name": "p", "namespace": "ns"},
                                                    "target": {"kind": "Node", "name": "n1"}})
        api.get(pod_path("ns", "p"))
        api.list("/api/v1/nodes")
        stream = api.watch("/api/v1/pods", str(server.resource_version), timeout_s=1)
        list(stream)
        counts = server.request_counts()
        assert server.requests == []  # keep_requests=False: counted, not logged
    assert counts == {"POST pods": 1, "PATCH pods": 1, "POST pods/binding": 1, "GET pods": 1, "GET nodes (list)": 1,
                      "GET pods (watch)": 1}


def test_every_pod_is_bound_with_three_writes_and_no_reads() -> None:
    run = kube_bench.run_kube_bench([20], pods=40, repeats=1, ceiling=True)
    figures = run.figures[0]
    scheduled, ceiling = figures.runs[0], figures.ceiling
    assert ceiling is not None
    for measured in (scheduled, ceiling):
        assert measured.bound == 40
        # PATCH (assignment), POST binding, POST event: what `gpuplane scheduler` writes, and what the ceiling's
        # client replays; the pods' own creates are the benchmark's.
        assert measured.requests_per_bound_pod["POST pods"] == 1.0
        assert measured.scheduler_writes_per_pod == 3.0
        assert measured.reads_beyond_watches == 0
        assert measured.pods_bound_per_s > 0 and measured.p99_ms >= measured.p50_ms > 0
    # CPU per bound pod of each process, from /proc (scheduler) and process_time (this one); one run: its median.
    assert scheduled.scheduler_cpu_ms_per_pod > 0 and scheduled.client_cpu_ms_per_pod > 0
    assert figures.median_scheduler_cpu_ms_per_pod == scheduled.scheduler_cpu_ms_per_pod
    # 20 nodes are below the 5,000 the throughput target is set at: nothing is missed.
    assert run.ok, run.misses
