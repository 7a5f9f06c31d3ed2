"""`gpuplane extender`: serve kube-scheduler's HTTP extender; and its loopback load test (`run_load`).

The load test builds a simulated 1,000-GPU-node world in this process, serves the extender on loopback,
and drives it from a separate process (`multiprocessing`, spawn) with an open-loop stream of
filter+prioritize pairs in kube-scheduler's exact JSON (nodeCacheCapable: `NodeNames` of every node) over
keep-alive connections. Pair i starts at t0 + i/rate whatever the earlier pairs are doing; each pair is a
filter, then a prioritize of the nodes it passed, as kube-scheduler calls them. Latency is from writing a
request to reading its whole answer; `start_lag` is how late the client started pairs (client-side
queueing; it should stay near zero, or the client was the bottleneck).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import random
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from gpuplane.cli.common import (
    CardOnlyOneScopeOption,
    CardPolicyOption,
    NodePolicyOption,
    SeedOption,
    TopoOption,
    fail,
    policy_config,
)
from gpuplane.kube.api import ApiError, KubeConfigError, connect_api
from gpuplane.kube.cluster import KubeCluster
from gpuplane.kube.extender import (
    DEFAULT_PORT,
    DEFAULT_PREFIX,
    Extender,
    ExtenderServer,
    FilterAnswers,
    describe_nodes,
    normalise_prefix,
    scheduler_config,
)
from gpuplane.kube.objects import GPU_MODELS, RES_CORES, RES_GPU, RES_MEM, SCHEDULER_NAME, object_key
from gpuplane.kube.observed import KubeSchedulerLease, scheduled_by
from gpuplane.kube.pools import PoolSync
from gpuplane.model import (
    Catalog,
    Fraction,
    GpuForm,
    GpuplaneError,
    NodeSpec,
    Topology,
    WholeCards,
    default_catalog,
    make_request,
)
from gpuplane.port.metrics import PlaneMetrics
from gpuplane.scheduler import PolicyError, Profile, Scheduler, default_registry
from gpuplane.sim.cluster import SimCluster


# ------------------------------------------------------------------ policy
def build_profile(node_policy: str, card_policy: str | None, scope: str = "workload", topo: Path | None = None,
                  seed: int = 0) -> Profile:
    """The scheduler profile as `simulate` picks it; `GpuplaneError` naming the flag on a bad choice."""
    config = policy_config(node_policy, card_policy, scope, topo, seed)
    try:
        return default_registry().build(config)
    except PolicyError as exc:
        raise GpuplaneError(f"--node-policy/--card-policy: {exc}") from None


# ------------------------------------------------------------------ the command


def register(app: typer.Typer) -> None:
    for group in app.registered_groups:  # `gpuplane experiment extender-fill`, in the experiment group
        if group.name == "experiment" and group.typer_instance is not None:
            register_experiment(group.typer_instance)

    @app.command("extender")
    def extender(
        port: Annotated[int, typer.Option(help="TCP port to listen on")] = DEFAULT_PORT,
        host: Annotated[str, typer.Option(help="address to listen on (a kube-scheduler sidecar: loopback)")]
            = "127.0.0.1",
        prefix: Annotated[str, typer.Option(help="URL path prefix of the verbs (the urlPrefix's path)")]
            = DEFAULT_PREFIX,
        node_policy: NodePolicyOption = "binpack",
        card_policy: CardPolicyOption = None,
        card_only_one_scope: CardOnlyOneScopeOption = "workload",
        topo: TopoOption = None,
        seed: SeedOption = 0,
        kubeconfig: Annotated[Path | None, typer.Option(
            help="kubeconfig file (default: in-cluster config, else $KUBECONFIG or ~/.kube/config)")] = None,
        context: Annotated[str | None, typer.Option(help="kubeconfig context")] = None,
        print_config: Annotated[bool, typer.Option(
            "--print-config", help="print the KubeSchedulerConfiguration that calls this extender, and exit")]
            = False,
        filter_answers: Annotated[str, typer.Option(
            "--filter-answers", help="what filter passes: chosen (only the node gpuplane picks, so kube-scheduler "
                                     "binds there) or feasible (every node that fits; kube-scheduler's scorers "
                                     "then weigh in)")] = FilterAnswers.CHOSEN.value,
        metrics_port: Annotated[int | None, typer.Option(min=0, max=65535, help=(
            "serve Prometheus metrics (GET /metrics) on this port, on all addresses: the requests by verb and "
            "result, and the cluster's figures as --observe says (docs/monitoring.md); 0: a free port "
            "[default: none]"))] = None,
        observe: Annotated[str, typer.Option(help=(
            "with --metrics-port, when to export the cluster's figures: leading (while the kube-scheduler in "
            "this pod holds --kube-scheduler-lease, so two replicas never count an event twice) or always"))
            ] = "leading",
        kube_scheduler_lease: Annotated[str, typer.Option(help=(
            "NAMESPACE/NAME of kube-scheduler's Lease (leaderElection in its configuration)"))]
            = f"gpuplane-system/{SCHEDULER_NAME}",
    ) -> None:
        """Serve kube-scheduler's HTTP extender (filter, prioritize, bind, preempt) over the cluster's API.

        Per-pool settings come from the GpuPools (`oversubscriptionRatio`: card memory promised per byte on
        nodes labelled `gpuplane.io/pool: <pool>`), watched while serving; invalid ones are logged and skipped."""
        if not 0 <= port <= 65535:
            fail(f"--port: must be 0…65535, got {port}")
        if print_config:
            url = f"http://{host}:{port}{normalise_prefix(prefix)}"
            typer.echo(yaml.safe_dump(scheduler_config(url), sort_keys=False), nl=False)
            return
        answers = parse_filter_answers(filter_answers)
        if observe not in ("leading", "always"):
            fail(f"--observe: choose leading or always, got {observe!r}")
        lease_namespace, _, lease_name = kube_scheduler_lease.partition("/")
        if not lease_namespace or not lease_name or "/" in lease_name:
            fail(f"--kube-scheduler-lease: NAMESPACE/NAME, got {kube_scheduler_lease!r}")
        if kubeconfig is not None and not kubeconfig.is_file():
            fail(f"--kubeconfig: {kubeconfig} is not a file")
        try:
            profile = build_profile(node_policy, card_policy, card_only_one_scope, topo, seed)
        except GpuplaneError as exc:
            fail(str(exc))
        catalog = default_catalog()
        cluster = _kube_cluster(catalog, str(kubeconfig) if kubeconfig is not None else None, context)
        metrics = PlaneMetrics() if metrics_port is not None else None
        core = Extender(cluster, catalog, profile, seed=seed, now=time.time, subscribe_lock=cluster.lock,
                        uid_names=lambda uid: _pod_by_uid(cluster, uid), filter_answers=answers, metrics=metrics,
                        observe=observe == "always", own_pods=scheduled_by(cluster.pods.get, SCHEDULER_NAME))
        stop = threading.Event()
        if metrics is not None:
            try:
                served = metrics.serve(metrics_port or 0)
            except OSError as exc:
                fail(f"--metrics-port {metrics_port}: {exc}")
            typer.echo(f"metrics on :{served}/metrics (cluster figures: {observe})", err=True)
            if observe == "leading":
                lease = KubeSchedulerLease(cluster.api, lease_namespace, lease_name, now=time.monotonic)
                threading.Thread(target=follow_lease, args=(core, lease, stop), name="kube-scheduler lease",
                                 daemon=True).start()
        # The GpuPools' settings (memory oversubscription) per pool label, kept current while serving.
        pools = PoolSync(cluster.api, catalog, core, subscribe_lock=cluster.lock)
        pools.start()
        server = ExtenderServer(core, host=host, port=port, prefix=prefix)
        gc.freeze()  # the cache is long-lived: keep the collector off it (fewer, shorter pauses)
        table = core.scheduler.pools or {}
        typer.echo(f"gpuplane extender on {server.url} ({profile.name}, filter answers {answers.value}; "
                   f"{describe_nodes(core.scheduler.state.nodes)}; GpuPools: "
                   f"{', '.join(f'{k} ×{v.memory_oversell:g}' for k, v in sorted(table.items())) or 'none'})",
                   err=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            pools.stop()
            core.close()
            cluster.close()


def follow_lease(core: Extender, lease: KubeSchedulerLease, stop: threading.Event, period_s: float = 2.0) -> None:
    """Until `stop`: every `period_s`, observe the cluster while the kube-scheduler beside us leads, else not."""
    while not stop.is_set():
        leads = lease.leads()
        if leads and core.start_observing():
            typer.echo("kube-scheduler leads: exporting the cluster's figures", err=True)
        elif not leads and core.stop_observing():
            typer.echo("kube-scheduler does not lead: cluster figures no longer exported", err=True)
        stop.wait(period_s)


def parse_filter_answers(raw: str) -> FilterAnswers:
    try:
        return FilterAnswers(raw)
    except ValueError:
        fail(f"--filter-answers: choose chosen or feasible, got {raw!r}")


def _kube_cluster(catalog: Catalog, kubeconfig: str | None, context: str | None) -> KubeCluster:
    try:
        api = connect_api(kubeconfig, context)
    except KubeConfigError as exc:
        fail(f"--kubeconfig: cannot load a configuration: {exc}")
    try:
        return KubeCluster(api, catalog)
    except (TimeoutError, ApiError) as exc:
        fail(f"cannot list nodes and pods from the API server: {exc}")


def _pod_by_uid(cluster: KubeCluster, uid: str) -> str | None:
    """`namespace/name` of the pod with `uid` in the cluster port's informer cache (preemption, rarely)."""
    for pod in cluster.pods.objects():
        if pod.get("metadata", {}).get("uid") == uid:
            return object_key(pod)
    return None


# ------------------------------------------------------------------ the load test: world
LOAD_MODELS: tuple[tuple[str, int, int], ...] = (
    # (model, cards per node, share of nodes in %)
    ("A100-40GB", 8, 20), ("A100-80GB", 8, 15), ("H100-80GB", 8, 15), ("V100-32GB", 8, 10),
    ("T4", 4, 15), ("A10", 4, 10), ("L4", 8, 15),
)


def load_world(nodes: int = 1000, *, seed: int = 0, used: float = 0.4) -> tuple[Catalog, SimCluster]:
    """A simulated cluster of `nodes` GPU nodes of mixed models, about `used` of the GPUs taken by pods
    of mixed shapes (whole cards and shares) placed at random, so most nodes are partly used."""
    catalog = default_catalog()
    rng = random.Random(seed)
    weights = [share for _, _, share in LOAD_MODELS]
    specs: list[NodeSpec] = []
    for i in range(nodes):
        model, cards, _ = rng.choices(LOAD_MODELS, weights)[0]
        specs.append(NodeSpec(name=f"gpu-node-{i:04d}", cpu_milli=cards * 12_000, memory_mib=cards * 98_304,
                              gpu_model=model, gpus=cards, topology=Topology.default(cards)))
    world = SimCluster(catalog, specs)
    filler = Scheduler(world, catalog, build_profile("random", None, seed=seed), seed=seed)
    target = used * sum(spec.gpus for spec in specs) * 1000
    taken = 0
    i = 0
    while taken < target:
        shape = rng.random()
        if shape < 0.5:
            gpu: GpuForm = WholeCards(rng.choice((1, 1, 2, 4)))
        else:
            gpu = Fraction(compute_milli=rng.choice((250, 500)), memory_mib=rng.choice((4096, 8192)))
        request = make_request(catalog, f"load/filler-{i}", cpu_milli=2000, memory_mib=8192, gpu=gpu)
        world.create_pod(request)
        i += 1
        taken += request.gpu_milli_total
    filler.run_pending()
    filler.close()
    return catalog, world


def sample_pod(name: str, *, namespace: str = "default", uid: str | None = None, cards: int = 1,
               cores: int | None = None, memory_mib: int | None = None, models: Sequence[str] = (),
               resource_version: str = "1") -> dict[str, Any]:
    """A pending `v1.Pod` asking for gpuplane's resources, as kube-scheduler sends it."""
    limits: dict[str, str] = {RES_GPU: str(cards), "cpu": "2", "memory": "8Gi"}
    if cores is not None:
        limits[RES_CORES] = str(cores)
    if memory_mib is not None:
        limits[RES_MEM] = str(memory_mib)
    annotations = {GPU_MODELS: ",".join(models)} if models else {}
    return {
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{namespace}-{name}",
                     "resourceVersion": resource_version, "annotations": annotations,
                     "creationTimestamp": "2026-11-29T15:31:00Z"},
        "spec": {"schedulerName": "gpuplane-scheduler", "priority": 0,
                 "containers": [{"name": "main", "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                                 "resources": {"limits": limits, "requests": dict(limits)}}]},
        "status": {"phase": "Pending"},
    }


LOAD_PODS: tuple[Mapping[str, Any], ...] = (
    {"cards": 1},
    {"cards": 1, "cores": 50, "memory_mib": 8192},
    {"cards": 2},
    {"cards": 4, "models": ("A100-80GB", "H100-80GB")},
    {"cards": 1, "cores": 30, "memory_mib": 20000, "models": ("T4", "L4")},
    {"cards": 8},
)


# ------------------------------------------------------------------ the load test: client process
@dataclass(frozen=True, slots=True)
class VerbFigures:
    requests: int
    median_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True, slots=True)
class LoadResult:
    rate: float
    duration_s: float
    nodes: int
    connections: int
    pairs_sent: int
    pairs_done: int
    achieved_pairs_per_s: float
    errors: int
    verbs: dict[str, VerbFigures]
    start_lag_p99_ms: float
    start_lag_max_ms: float
    error_samples: list[str] = field(default_factory=list)

    def ok(self, *, p99_ms: float = 50.0) -> bool:
        return self.errors == 0 and all(v.p99_ms < p99_ms for v in self.verbs.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _figures(samples: list[float]) -> VerbFigures:
    if not samples:
        return VerbFigures(0, 0.0, 0.0, 0.0)
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, max(0, int(len(ordered) * 0.99 + 0.5) - 1))]
    return VerbFigures(len(ordered), round(statistics.median(ordered) * 1000, 3), round(p99 * 1000, 3),
                       round(ordered[-1] * 1000, 3))


async def _call(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], path: bytes,
                body: bytes) -> tuple[int, bytes]:
    reader, writer = conn
    writer.write(b"POST %s HTTP/1.1\r\nHost: extender\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path, len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return status, await reader.readexactly(length)


async def _drive(host: str, port: int, prefix: str, names: list[str], rate: float, duration_s: float,
                 connections: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    pool: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(await asyncio.open_connection(host, port))
    pods = [sample_pod(f"load-{i}", namespace="load", **spec) for i, spec in enumerate(LOAD_PODS)]
    filter_bodies = [json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}, separators=(",", ":")).encode()
                     for pod in pods]
    filter_path, prioritize_path = f"{prefix}/filter".encode(), f"{prefix}/prioritize".encode()
    latency: dict[str, list[float]] = {"filter": [], "prioritize": []}
    lags: list[float] = []
    errors: list[str] = []
    done = 0

    async def pair(i: int, at: float) -> None:
        nonlocal done
        conn = await pool.get()
        lags.append(loop.time() - at)
        healthy = False
        try:
            k = i % len(pods)
            start = loop.time()
            status, answer = await _call(conn, filter_path, filter_bodies[k])
            latency["filter"].append(loop.time() - start)
            result = json.loads(answer)
            if status != 200 or result.get("Error"):
                errors.append(f"filter: HTTP {status} {answer[:200]!r}")
                return
            passed = result["NodeNames"]
            body = json.dumps({"Pod": pods[k], "Nodes": None, "NodeNames": passed},
                              separators=(",", ":")).encode()
            start = loop.time()
            status, answer = await _call(conn, prioritize_path, body)
            latency["prioritize"].append(loop.time() - start)
            scores = json.loads(answer)
            if status != 200 or not isinstance(scores, list) or len(scores) != len(passed):
                errors.append(f"prioritize: HTTP {status} {answer[:200]!r}")
                return
            done += 1
            healthy = True
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            if healthy:
                pool.put_nowait(conn)
            else:  # a connection in an unknown state is replaced
                conn[1].close()
                try:
                    pool.put_nowait(await asyncio.open_connection(host, port))
                except OSError as exc:
                    errors.append(f"reconnect: {exc}")

    total = int(rate * duration_s)
    t0 = loop.time() + 0.2
    tasks = []
    for i in range(total):
        at = t0 + i / rate
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(pair(i, at)))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - t0
    while not pool.empty():
        pool.get_nowait()[1].close()
    return {"latency": latency, "lags": lags, "errors": errors, "done": done, "sent": total, "elapsed": elapsed}


def _client(host: str, port: int, prefix: str, names: list[str], rate: float, duration_s: float,
            connections: int, out: Any) -> None:
    """The load generator's process: runs the open loop and sends its raw samples back over `out`."""
    out.send(asyncio.run(_drive(host, port, prefix, names, rate, duration_s, connections)))
    out.close()


def run_load(*, rate: float = 200.0, duration_s: float = 60.0, nodes: int = 1000, connections: int = 32,
             seed: int = 0, node_policy: str = "binpack") -> LoadResult:
    """Serve an extender over a simulated `nodes`-node world on loopback and drive `rate` filter+prioritize
    pairs per second at it for `duration_s` from a separate process. Prints nothing; returns the figures."""
    if rate <= 0 or duration_s <= 0 or nodes < 1 or connections < 1:
        raise GpuplaneError("rate, duration, nodes and connections must be positive")
    catalog, world = load_world(nodes, seed=seed)
    names = [info.name for info in world.list_nodes()]
    core = Extender(world, catalog, build_profile(node_policy, None), seed=seed)
    gc.collect()
    gc.freeze()
    server = ExtenderServer(core, port=0).start()
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    host, port = server.address
    child = context.Process(target=_client, args=(host, port, server.prefix, names, rate, duration_s,
                                                  connections, send), daemon=True)
    try:
        child.start()
        send.close()
        raw = receive.recv()
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.terminate()
        server.close()
        core.close()
        gc.unfreeze()
    verbs = {verb: _figures(samples) for verb, samples in raw["latency"].items()}
    lags = _figures(raw["lags"])
    return LoadResult(rate=rate, duration_s=duration_s, nodes=nodes, connections=connections,
                      pairs_sent=raw["sent"], pairs_done=raw["done"],
                      achieved_pairs_per_s=round(raw["done"] / raw["elapsed"], 2), errors=len(raw["errors"]),
                      verbs=verbs, start_lag_p99_ms=lags.p99_ms, start_lag_max_ms=lags.max_ms,
                      error_samples=raw["errors"][:5])


def format_load(result: LoadResult) -> str:
    lines = [f"extender load: {result.nodes} nodes, {result.rate:g} filter+prioritize pairs/s for "
             f"{result.duration_s:g} s over {result.connections} keep-alive connections",
             f"  pairs: {result.pairs_done}/{result.pairs_sent} done, {result.achieved_pairs_per_s:g}/s achieved, "
             f"{result.errors} errors"]
    for verb, figures in result.verbs.items():
        lines.append(f"  {verb:<10} n={figures.requests:<6} median {figures.median_ms:7.2f} ms   "
                     f"p99 {figures.p99_ms:7.2f} ms   max {figures.max_ms:7.2f} ms")
    lines.append(f"  client start lag: p99 {result.start_lag_p99_ms:.2f} ms, max {result.start_lag_max_ms:.2f} ms")
    lines.extend(f"  error: {sample}" for sample in result.error_samples)
    return "\n".join(lines)


# ------------------------------------------------------------------ the fill replay through the extender
@dataclass(frozen=True, slots=True)
class ExtenderFillFigures:
    """`gpuplane experiment extender-fill`: the simulator's fill and the same pods through the extender."""

    trace: str
    node_policy: str
    seed: int
    pods: int
    """Pods replayed (the first `pods` of the tuned workload)."""
    reached_100: bool
    """Whether those pods bring the arrived workload to 100 % of GPU capacity (else `*_at_100` is after them)."""
    simulator_unallocated_pct_at_100: float
    simulator_unallocated_pct_after: float
    extender: dict[str, dict[str, Any]]
    """Per filter-answers mode: unallocated % at 100 % arrived and after the pods, the difference to the
    simulator's in points, pods placed on another node or cards than the simulator's, and the wall time."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def extender_fill(trace: str = "default", node_policy: str = "fgd", card_policy: str | None = None, *,
                  seed: int = 42, pods: int | None = None, modes: Sequence[FilterAnswers] = tuple(FilterAnswers),
                  split: int = 10, progress: Any = None) -> ExtenderFillFigures:
    """Fill-replay `trace` in the simulator, then the first `pods` of the same tuned workload through the local API
    server, `KubeCluster`, the extender over HTTP and the kube-scheduler stand-in, once per filter-answers mode."""
    from gpuplane.kube.standin import fill_through_extender
    from gpuplane.scheduler.plugins.frag import TypicalPods
    from gpuplane.sim.replay import run_fill, tune_workload
    from gpuplane.sim.trace import bundled_path, load_nodes, load_pods, resolve_trace

    catalog = default_catalog()
    nodes = load_nodes(bundled_path("nodes"), catalog)
    requests = [p.request for p in load_pods(resolve_trace(trace), catalog)]
    typical = TypicalPods.from_workload(requests)

    def profile() -> Profile:
        config = policy_config(node_policy, card_policy, "workload", None, seed, typical=typical)
        try:
            return default_registry().build(config)
        except PolicyError as exc:
            raise GpuplaneError(f"--node-policy/--card-policy: {exc}") from None

    simulated = run_fill(catalog, nodes, requests, profile(), seed=seed, trace=trace, record_placements=True)
    capacity = sum(spec.gpus for spec in nodes) * 1000
    workload = tune_workload(requests, capacity, seed)
    count = len(workload) if pods is None else max(1, min(pods, len(workload)))
    workload = workload[:count]
    reached = bool(simulated.arrived_pct[count - 1] >= 100.0)
    sim_at_100 = simulated.unallocated_at(100.0) if reached else 100.0 - float(simulated.allocation_pct[count - 1])
    sim_after = 100.0 - float(simulated.allocation_pct[count - 1])
    figures: dict[str, dict[str, Any]] = {}
    for mode in modes:
        result = fill_through_extender(catalog, nodes, workload, profile(), seed=seed, filter_answers=mode,
                                       split=split, progress=progress)
        at_100 = result.unallocated_at(100.0) if reached else result.unallocated_at_end
        differences = sum(1 for a, b in zip(simulated.placements, result.placements, strict=False)
                          if (a.node, tuple(a.cards)) != (b.node, b.cards))
        figures[mode.value] = {
            "unallocated_pct_at_100": round(at_100, 3), "unallocated_pct_after": round(result.unallocated_at_end, 3),
            "points_from_simulator_at_100": round(at_100 - sim_at_100, 3), "placed": result.placed,
            "differences": differences, "wall_s": round(result.wall_s, 1)}
    return ExtenderFillFigures(trace, node_policy, seed, count, reached, round(sim_at_100, 3), round(sim_after, 3),
                               figures)


def register_experiment(experiment: typer.Typer) -> None:
    @experiment.command("extender-fill")
    def extender_fill_cmd(
        trace: Annotated[str, typer.Option(help="default, gpushare40, gpushare100 or a pod CSV")] = "default",
        node_policy: Annotated[str, typer.Option("--node-policy", help="gpuplane's node policy")] = "fgd",
        card_policy: Annotated[str | None, typer.Option(help="card policy (default: the node policy's own)")]
            = None,
        seed: Annotated[int, typer.Option(help="seed of the tuning and of every tie-break")] = 42,
        pods: Annotated[int | None, typer.Option(help="replay only the first N pods of the tuned workload")] = None,
        filter_answers: Annotated[str, typer.Option(
            "--filter-answers", help="chosen, feasible or both")] = "both",
        split: Annotated[int, typer.Option(help="gpuplane.io/gpu units each card advertises")] = 10,
        as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    ) -> None:
        """The fill replay through kube-scheduler's extender protocol (a faithful stand-in) beside the simulator."""
        modes = tuple(FilterAnswers) if filter_answers == "both" else (parse_filter_answers(filter_answers),)
        if split < 1:
            fail(f"--split: must be at least 1, got {split}")
        try:
            figures = extender_fill(trace, node_policy, card_policy, seed=seed, pods=pods, modes=modes, split=split)
        except GpuplaneError as exc:
            fail(str(exc))
        if as_json:
            typer.echo(json.dumps(figures.to_json(), indent=2))
            return
        when = "at 100 % arrived" if figures.reached_100 else "after them (100 % not reached)"
        typer.echo(f"{figures.trace}, {figures.node_policy}, seed {figures.seed}, {figures.pods} pods: simulator "
                   f"{figures.simulator_unallocated_pct_at_100:.2f} % unallocated {when}")
        for mode, row in figures.extender.items():
            typer.echo(f"  extender, filter answers {mode:<8} {row['unallocated_pct_at_100']:.2f} % "
                       f"({row['points_from_simulator_at_100']:+.2f} points; {row['differences']} pods placed "
                       f"elsewhere; {row['wall_s']:g} s)")
