"""SchedulingQueue: priority then arrival, parking, and capacity hints that reactivate parked pods."""

from __future__ import annotations

from builders import cluster, node, pod
from gpuplane.model import Assignment, CardShare, ClusterState, MigMode, PodRequest
from gpuplane.scheduler import SchedulingQueue
from gpuplane.scheduler.queue import QueuedPod


def drain(queue: SchedulingQueue) -> list[str]:
    names = []
    while (entry := queue.pop()) is not None:
        names.append(entry.request.name)
    return names


def pop(queue: SchedulingQueue) -> QueuedPod:
    entry = queue.pop()
    assert entry is not None
    return entry


def park_all(queue: SchedulingQueue) -> None:
    while (entry := queue.pop()) is not None:
        queue.park(entry)


def test_priority_then_arrival() -> None:
    queue = SchedulingQueue()
    queue.add(pod("a").obj(), 0.0)
    queue.add(pod("b").priority(5).obj(), 1.0)
    queue.add(pod("c").priority(5).obj(), 2.0)
    queue.add(pod("d").obj(), 3.0)
    queue.add(pod("e").priority(-1).obj(), 4.0)
    queue.add(pod("f").priority(9).obj(), 5.0)
    assert len(queue) == 6
    assert drain(queue) == ["f", "b", "c", "a", "d", "e"]
    assert queue.pop() is None
    assert len(queue) == 0


def test_add_is_idempotent_and_pop_counts_attempts() -> None:
    queue = SchedulingQueue()
    queue.add(pod("a").obj(), 1.0)
    queue.add(pod("a").priority(9).obj(), 2.0)  # already queued: ignored
    assert len(queue) == 1 and "a" in queue and "b" not in queue
    entry = pop(queue)
    assert (entry.request.priority, entry.enqueued_at, entry.attempts) == (0, 1.0, 1)
    assert "a" not in queue
    queue.park(entry)
    assert "a" in queue and len(queue) == 1
    queue.add(pod("a").obj(), 3.0)  # parked: still ignored
    assert [e.request.name for e in queue.parked] == ["a"]
    assert queue.activate_all() == 1
    entry = pop(queue)
    assert (entry.attempts, entry.enqueued_at) == (2, 1.0)


def test_remove_from_active_and_parked() -> None:
    queue = SchedulingQueue()
    for name in "abc":
        queue.add(pod(name).obj(), 0.0)
    queue.park(pop(queue))  # a parked
    queue.remove("a")
    queue.remove("b")
    queue.remove("nobody")
    assert queue.parked == [] and len(queue) == 1
    assert drain(queue) == ["c"]


def test_readded_pod_keeps_arrival_order() -> None:
    # A pod deleted and created again arrives anew: it must not jump ahead using its old place.
    queue = SchedulingQueue()
    queue.add(pod("a").obj(), 0.0)
    queue.remove("a")
    queue.add(pod("b").obj(), 1.0)
    queue.add(pod("a").obj(), 2.0)
    assert drain(queue) == ["b", "a"]
    assert queue.pop() is None


def test_readded_pod_takes_its_new_priority() -> None:
    queue = SchedulingQueue()
    queue.add(pod("a").priority(9).obj(), 0.0)
    queue.add(pod("b").priority(5).obj(), 0.0)
    queue.remove("a")
    queue.add(pod("a").priority(1).obj(), 1.0)
    assert drain(queue) == ["b", "a"]


def test_activate_all_requeues_by_priority() -> None:
    queue = SchedulingQueue()
    queue.add(pod("low").obj(), 0.0)
    queue.add(pod("high").priority(3).obj(), 1.0)
    queue.add(pod("mid").priority(1).obj(), 2.0)
    park_all(queue)
    assert len(queue.parked) == 3 and queue.pop() is None
    queue.add(pod("new").priority(2).obj(), 3.0)
    assert queue.activate_all() == 3
    assert queue.activate_all() == 0
    assert drain(queue) == ["high", "new", "mid", "low"]


# ---------------------------------------------------------------------------- capacity hints

def full_node() -> ClusterState:
    """4×A100, every card held whole by pods h0..h3, 8 of 64 cores left."""
    state = cluster(node("n").gpus(4).cpu(64000).mem(262144).obj())
    for c in range(4):
        state.place(pod(f"h{c}").whole(1).cpu(14000).obj(), Assignment("n", (CardShare(c, 1000, 40960, 0, 5,
                                                                                        whole=True),)))
    return state


def parked_queue(*requests: PodRequest) -> SchedulingQueue:
    queue = SchedulingQueue()
    for request in requests:
        queue.add(request, 0.0)
    park_all(queue)
    return queue


def test_whole_card_pod_needs_enough_idle_cards() -> None:
    state = full_node()
    queue = parked_queue(pod("two").whole(2).obj())
    assert queue.activate_for_node(state, 0) == 0
    state.release("h0")  # 1 idle card
    assert state.idle_cards[0] == 1
    assert queue.activate_for_node(state, 0) == 0
    assert [e.request.name for e in queue.parked] == ["two"]
    state.release("h1")  # 2 idle cards
    assert queue.activate_for_node(state, 0) == 1
    assert queue.parked == []
    assert pop(queue).request.name == "two"


def test_fraction_pod_needs_a_card_share() -> None:
    state = cluster(node("n").gpus(2).obj())
    state.place(pod("x").fraction(500).obj(), Assignment("n", (CardShare(0, 500, 0),)))
    state.place(pod("y").fraction(700).obj(), Assignment("n", (CardShare(1, 700, 0),)))
    queue = parked_queue(pod("f600").fraction(600).obj(), pod("f500").fraction(500).obj(),
                         pod("memonly").fraction(mem=1024).obj())
    # largest free share is 500 milli (card 0): f500 and the memory-only fraction may fit, f600 not
    assert queue.activate_for_node(state, 0) == 2
    assert [e.request.name for e in queue.parked] == ["f600"]
    assert drain(queue) == ["f500", "memonly"]
    state.release("y")
    assert queue.activate_for_node(state, 0) == 1
    assert drain(queue) == ["f600"]


def test_fraction_hint_ignores_cards_in_mig_mode() -> None:
    state = cluster(node("n").gpus(1).mig(MigMode.ON).obj(), node("c").obj())
    queue = parked_queue(pod("f").fraction(100).obj(), pod("m").mig(19).obj())
    # the only card is in MIG mode: a fraction cannot use it, a MIG pod might
    assert queue.activate_for_node(state, 0) == 1
    assert drain(queue) == ["m"]
    # a CPU-only node has no card share for the fraction
    assert queue.activate_for_node(state, 1) == 0


def test_cpu_and_memory_hints() -> None:
    state = full_node()  # 8000 milli CPU and 262144 MiB left
    queue = parked_queue(pod("cpu9").cpu(9000).obj(), pod("cpu7").cpu(7000).obj(),
                         pod("mem").mem(262145).obj(), pod("both").cpu(100).mem(100).obj())
    # cpu9 and mem can never fit; cpu7 (7000 of 8000) and then both (100 of the 1000 left) do.
    assert queue.activate_for_node(state, 0) == 2
    assert sorted(e.request.name for e in queue.parked) == ["cpu9", "mem"]
    assert drain(queue) == ["cpu7", "both"]
    state.release("h0")  # 8000 + 14000 = 22000 milli CPU free
    assert queue.activate_for_node(state, 0) == 1
    assert drain(queue) == ["cpu9"]


def test_reactivation_spends_a_budget_in_arrival_order() -> None:
    state = full_node()  # 8000 milli CPU left
    queue = parked_queue(pod("first").cpu(6000).obj(), pod("second").cpu(6000).obj(),
                         pod("small").cpu(2000).obj(), pod("tiny").cpu(500).obj())
    # first takes 6000 (2000 left); second (6000) no longer fits, and no later pod of its shape is
    # looked at; small takes the last 2000; tiny (500) finds nothing left.
    assert queue.activate_for_node(state, 0) == 2
    assert drain(queue) == ["first", "small"]
    assert sorted(e.request.name for e in queue.parked) == ["second", "tiny"]


def test_reactivation_keeps_arrival_order_across_retries() -> None:
    queue = SchedulingQueue()
    queue.add(pod("old").obj(), 0.0)
    queue.add(pod("new").obj(), 1.0)
    old = pop(queue)
    queue.park(old)  # old failed and waits
    new = pop(queue)
    queue.park(new)
    queue.activate_all()
    assert drain(queue) == ["old", "new"]


def test_activate_for_node_without_parked_pods() -> None:
    queue = SchedulingQueue()
    queue.add(pod("a").obj(), 0.0)
    assert queue.activate_for_node(full_node(), 0) == 0
    assert drain(queue) == ["a"]
