"""The fair queue: strict priority, start-time fair turns across tenants (a tenant under its share
goes first, for a bounded burst; requests admitted at once count as turns; credit starts afresh after a busy
period), workflow continuations first within a tenant, how many a new request would follow and which it would
go before, removal, and who is shed when it is full."""

from collections import Counter

import pytest

from admission.fair_queue import IDLE_CREDIT_TURNS, FairQueue, QueuedRequest
from admission.priority import Priority

CRITICAL, STANDARD, BATCH = Priority.CRITICAL, Priority.STANDARD, Priority.BATCH


def request(tenant: str, priority: Priority = STANDARD, weight: float = 1.0, step: int | None = None,
            name: str | None = None) -> QueuedRequest:
    return QueuedRequest(tenant, priority, weight, workflow_step=step, handle=name or tenant)


def fill(queue: FairQueue, tenant: str, count: int, **kwargs) -> list[QueuedRequest]:
    requests = [request(tenant, name=f"{tenant}{i}", **kwargs) for i in range(count)]
    for r in requests:
        assert queue.push(r) is None
    return requests


def drain(queue: FairQueue, count: int | None = None) -> list[str]:
    served = []
    while count is None or len(served) < count:
        r = queue.pop()
        if r is None:
            break
        served.append(r.handle)
    return served


def test_an_empty_queue_pops_nothing():
    queue = FairQueue(4)
    assert queue.pop() is None and len(queue) == 0


def test_one_tenant_is_served_in_arrival_order():
    queue = FairQueue(10)
    fill(queue, "a", 5)
    assert drain(queue) == ["a0", "a1", "a2", "a3", "a4"]


def test_weights_3_to_1_give_a_3_to_1_service_order():
    queue = FairQueue(1000)
    fill(queue, "heavy", 400, weight=3)
    fill(queue, "light", 400, weight=1)
    served = [name.rstrip("0123456789") for name in drain(queue, 400)]
    assert Counter(served) == {"heavy": 300, "light": 100}
    for start in range(0, 400, 4):  # and not in long runs: three to one in every four
        assert Counter(served[start:start + 4]) == {"heavy": 3, "light": 1}, start


def test_equal_weights_take_turns():
    queue = FairQueue(100)
    fill(queue, "a", 10)
    fill(queue, "b", 10)
    served = drain(queue, 10)
    assert served == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]


def test_a_flooding_tenant_waits_behind_its_own_requests():
    queue = FairQueue(1000)
    fill(queue, "flood", 500)
    drain(queue, 10)
    assert queue.push(request("light", name="late")) is None
    assert "late" in drain(queue, 2)


def test_a_light_tenant_arriving_after_a_flood_is_served_among_the_first():
    queue = FairQueue(1000)
    fill(queue, "flood", 500)
    queue.push(request("light", name="light0"))
    queue.push(request("light", name="light1"))
    assert drain(queue, 4) == ["flood0", "light0", "flood1", "light1"]


def test_a_light_tenant_arriving_beside_a_flood_is_served_at_the_next_pop():
    queue = FairQueue(1000)
    fill(queue, "flood", 500)
    drain(queue, 10)
    queue.push(request("light", name="light0"))
    assert drain(queue, 1) == ["light0"]
    queue.push(request("light", name="light1"))
    queue.push(request("light", name="light2"))
    assert drain(queue, 3) == ["light1", "light2", "flood10"]  # under its share: its burst goes first


def test_an_idle_tenant_banks_a_bounded_credit():
    queue = FairQueue(1000)
    fill(queue, "busy", 200)
    drain(queue, 100)  # "late" was idle all this time: busy's next turn is one past the virtual time
    credit = int(IDLE_CREDIT_TURNS)
    fill(queue, "late", credit + 10)
    served = [name.rstrip("0123456789") for name in drain(queue, credit + 11)]
    burst = credit + 1  # its turns from the virtual time - credit up to the virtual time
    assert served[:burst] == ["late"] * burst
    assert Counter(served[burst:]) == {"busy": 5, "late": 5}  # then turns, one each


def test_a_tenant_under_its_share_beside_a_flood_goes_first_and_one_over_it_takes_turns():
    queue = FairQueue(1000)
    fill(queue, "flood", 500)
    drain(queue, 20)
    served = []
    for step in range(99):  # "light" sends bursts of three, one every nine served (a third of the pool)
        if step % 9 == 0:
            for i in range(3):
                queue.push(request("light", name=f"light{step + i}"))
        served.extend(drain(queue, 1))
    light = [name for name in served if name.startswith("light")]
    assert [served.index(name) for name in light] == [int(name[5:]) for name in light]  # each burst at once
    fill(queue, "light", 100)
    tail = [name.rstrip("0123456789") for name in drain(queue, int(IDLE_CREDIT_TURNS) + 40)]
    assert Counter(tail[-40:]) == {"flood": 20, "light": 20}  # once it floods too (its credit spent): its share


def test_a_request_admitted_at_once_takes_its_tenants_turn():
    """Service counts alike whether it was queued or not: a tenant admitted at once five times, as a
    clump of permits came back, has five turns fewer of credit than one that was not."""
    queue = FairQueue(100)
    for _ in range(5):
        queue.serve_at_once(request("clumped"))
    fill(queue, "clumped", 3)
    fill(queue, "other", 3)
    assert drain(queue) == ["other0", "other1", "other2", "clumped0", "clumped1", "clumped2"]


@pytest.mark.parametrize(("ended", "first"), [(False, ["new"] * 6), (True, ["new", "busy"] * 3)],
                         ids=["same-busy-period", "busy-period-ended"])
def test_once_a_busy_period_ends_the_tenant_served_most_in_it_starts_the_next_with_full_credit(ended, first):
    queue = FairQueue(1000)
    fill(queue, "busy", 100)
    drain(queue)  # busy's next turn is one past the virtual time: no credit left
    if ended:
        queue.end_busy_period(STANDARD)
    fill(queue, "new", 10)
    fill(queue, "busy", 10)
    assert [name.rstrip("0123456789") for name in drain(queue, 6)] == first


def test_a_heavier_tenant_banks_credit_in_proportion_to_its_weight():
    queue = FairQueue(1000)
    fill(queue, "busy", 200)
    drain(queue, 100)
    burst = 2 * int(IDLE_CREDIT_TURNS) + 1
    fill(queue, "heavy", burst + 10, weight=2)
    served = [name.rstrip("0123456789") for name in drain(queue, burst + 3)]
    assert served[:burst] == ["heavy"] * burst and "busy" in served[burst:]


def test_priorities_are_served_strictly_whatever_the_arrival_order():
    queue = FairQueue(100)
    fill(queue, "b", 3, priority=BATCH)
    fill(queue, "s", 3, priority=STANDARD)
    fill(queue, "c", 3, priority=CRITICAL)
    queue.push(request("b", BATCH, weight=100, name="heavy-batch"))
    assert drain(queue) == ["c0", "c1", "c2", "s0", "s1", "s2", "b0", "b1", "b2", "heavy-batch"]


def test_a_more_urgent_arrival_goes_before_queued_work():
    queue = FairQueue(100)
    fill(queue, "b", 3, priority=BATCH)
    assert drain(queue, 1) == ["b0"]
    queue.push(request("c", CRITICAL, name="urgent"))
    assert drain(queue) == ["urgent", "b1", "b2"]


def test_most_urgent_is_the_priority_of_the_request_pop_returns_next():
    queue = FairQueue(100)
    assert queue.most_urgent() is None
    queue.push(request("b", BATCH))
    assert queue.most_urgent() == BATCH
    plain = request("s", STANDARD)
    queue.push(plain)
    fill(queue, "c", 2, priority=CRITICAL)
    assert queue.most_urgent() == CRITICAL
    served = []
    while (priority := queue.most_urgent()) is not None:
        r = queue.pop()
        assert r.priority == priority
        served.append(priority)
        if len(served) == 1:
            assert queue.remove(plain)  # a removal moves it as well
    assert served == [CRITICAL, CRITICAL, BATCH]
    assert queue.pop() is None


def test_workflow_continuations_go_before_their_tenants_new_work():
    queue = FairQueue(100)
    queue.push(request("a", name="new1"))
    queue.push(request("a", name="new2", step=1))  # a workflow's first step is new work
    queue.push(request("a", name="step2", step=2))
    queue.push(request("a", name="step5", step=5))
    assert drain(queue) == ["step2", "step5", "new1", "new2"]


def test_workflow_continuations_do_not_take_other_tenants_turns():
    queue = FairQueue(100)
    queue.push(request("b", name="b0"))
    queue.push(request("b", name="b1"))
    queue.push(request("a", name="a-new"))
    queue.push(request("a", name="a-step2", step=2))
    queue.push(request("a", name="a-step3", step=3))
    assert drain(queue) == ["b0", "a-step2", "b1", "a-step3", "a-new"]


def test_depth_counts_each_priority_and_ahead_of_counts_those_as_urgent_or_more():
    queue = FairQueue(100)
    fill(queue, "c", 1, priority=CRITICAL)
    fill(queue, "s", 2, priority=STANDARD)
    fill(queue, "b", 3, priority=BATCH)
    assert [queue.depth(p) for p in Priority] == [1, 2, 3]
    # each level's only tenant, or a newcomer whose first turn ties with its queued head
    assert [queue.ahead_of(request(t, p)) for t, p in [("c", CRITICAL), ("s", STANDARD), ("b", BATCH)]] == [1, 3, 6]
    assert [queue.ahead_of(request("new", p)) for p in Priority] == [1, 2, 4]
    assert len(queue) == 6 and {r.handle for r in queue} == {"c0", "s0", "s1", "b0", "b1", "b2"}


def test_ahead_of_a_new_tenant_counts_only_the_turns_before_its_next_and_a_backlogged_one_its_own_queue():
    queue = FairQueue(100)
    fill(queue, "flood", 10)
    drain(queue, 2)  # the flood's next turn is 2; the virtual time is 1
    fill(queue, "light", 2)  # turns 1 and 2
    fill(queue, "bulk", 5, priority=BATCH)
    assert queue.ahead_of(request("new")) == 1  # light's turn 1 is queued already; then the newcomer's
    assert queue.ahead_of(request("light")) == 3  # its own two, and flood's turn 2
    assert queue.ahead_of(request("flood")) == 10  # its own eight, and light's two
    assert queue.ahead_of(request("gold", CRITICAL)) == 0
    assert queue.ahead_of(request("new", BATCH)) == 11  # everything standard, and bulk's head


ARRIVALS = pytest.mark.parametrize(("steps", "newcomer"), [
    ([("flood", 5)], "new"),
    ([("flood", 5), 2], "new"),
    ([("flood", 5), ("a", 2), 3], "new"),
    ([("a", 3), ("b", 3), 1, ("c", 1)], "new"),
    ([("a", 3), 3, ("b", 4)], "a"),  # a comes back after its three were served
    ([("w2", 6), ("a", 4), 3], "new"),
    ([("a", 2), ("b", 3), 2, ("c", 2), 1], "a"),
], ids=["fresh-flood", "served-flood", "flood-and-light", "three-tenants", "returning-tenant", "weighted",
        "emptied-and-back"])


def queue_after(steps) -> FairQueue:
    """steps: (tenant, count) pushes that many (tenant w2 has weight 2); a number pops that many."""
    queue = FairQueue(100)
    for step in steps:
        if isinstance(step, int):
            drain(queue, step)
        else:
            fill(queue, step[0], step[1], weight=2 if step[0] == "w2" else 1)
    return queue


@ARRIVALS
def test_ahead_of_a_new_tenants_request_is_how_many_are_served_before_it(steps, newcomer):
    queue = queue_after(steps)
    arriving = request(newcomer, name="newcomer")
    predicted = queue.ahead_of(arriving)
    queue.push(arriving)
    served = drain(queue)
    assert served.index("newcomer") == predicted, served


@ARRIVALS
def test_behind_are_the_queued_requests_served_after_a_new_one(steps, newcomer):
    queue = queue_after(steps)
    arriving = request(newcomer, name="newcomer")
    passed = [r.handle for r in queue.behind(arriving)]
    assert len(passed) + queue.ahead_of(arriving) == len(queue)
    queue.push(arriving)
    served = drain(queue)
    assert sorted(passed) == sorted(served[served.index("newcomer") + 1:]), served


def test_behind_a_request_are_every_less_urgent_one_and_for_a_continuation_its_tenants_new_work():
    queue = FairQueue(100)
    fill(queue, "agent", 2)
    fill(queue, "other", 2)
    fill(queue, "bulk", 2, priority=BATCH)
    assert [r.handle for r in queue.behind(request("gold", CRITICAL))] == ["agent0", "agent1", "other0", "other1",
                                                                          "bulk0", "bulk1"]
    # a continuation takes its tenant's next turn, which comes before other's (queued later)
    assert [r.handle for r in queue.behind(request("agent", step=2))] == ["agent0", "agent1", "other0", "other1",
                                                                         "bulk0", "bulk1"]
    assert [r.handle for r in queue.behind(request("agent"))] == ["bulk0", "bulk1"]


def test_ahead_of_a_workflow_continuation_counts_only_its_tenants_continuations():
    queue = FairQueue(100)
    fill(queue, "agent", 5)
    fill(queue, "other", 5)
    drain(queue, 2)  # agent0, other0
    assert queue.ahead_of(request("agent")) == 8  # its four new requests, and other's four turns
    step2 = request("agent", step=2, name="step2")
    assert queue.ahead_of(step2) == 0
    queue.push(step2)
    assert queue.ahead_of(request("agent", step=3)) == 2  # step2, and other's turn between
    assert drain(queue, 1) == ["step2"]


def test_a_removed_request_is_never_served():
    queue = FairQueue(100)
    a = fill(queue, "a", 3)
    b = fill(queue, "b", 2)
    assert queue.remove(a[1]) and queue.remove(b[0]) and queue.remove(b[1])
    assert not queue.remove(a[1])
    assert len(queue) == 2
    assert drain(queue) == ["a0", "a2"]


def test_a_request_never_queued_is_not_removed():
    queue = FairQueue(100)
    fill(queue, "a", 1)
    assert not queue.remove(request("a")) and not queue.remove(request("other", BATCH))
    assert len(queue) == 1


def test_a_tenant_emptied_by_removal_comes_back_with_its_credit():
    queue = FairQueue(100)
    gone = fill(queue, "a", 1)[0]
    fill(queue, "b", 4)
    queue.remove(gone)
    drain(queue, 2)
    queue.push(request("a", name="back"))
    queue.push(request("a", name="back2"))
    assert drain(queue) == ["back", "back2", "b2", "b3"]  # its removed request cost it no credit


def test_a_tenant_back_after_a_removal_does_not_take_the_turn_of_one_queued_meanwhile():
    queue = FairQueue(100)
    queue.remove(fill(queue, "a", 1)[0])
    fill(queue, "b", 2)
    back = request("a", name="back")
    assert queue.ahead_of(back) == 1
    queue.push(back)
    assert drain(queue) == ["b0", "back", "b1"]


def test_a_removed_continuation_leaves_the_rest_in_order():
    queue = FairQueue(100)
    queue.push(request("a", name="new"))
    cont = request("a", name="step2", step=2)
    queue.push(cont)
    queue.push(request("a", name="step3", step=3))
    assert queue.remove(cont)
    assert drain(queue) == ["step3", "new"]


# -- shedding when full ------------------------------------------------------------------------


def test_when_full_the_heaviest_tenants_newest_request_is_shed():
    queue = FairQueue(4)
    fill(queue, "heavy", 3)
    fill(queue, "light", 1)
    shed = queue.push(request("light", name="light-late"))
    assert shed is not None and shed.handle == "heavy2"
    assert len(queue) == 4
    assert sorted(r.handle for r in queue) == ["heavy0", "heavy1", "light-late", "light0"]


def test_when_full_an_arrival_of_the_heaviest_tenant_is_itself_refused():
    queue = FairQueue(4)
    fill(queue, "heavy", 3)
    fill(queue, "light", 1)
    arriving = request("heavy", name="heavy-late")
    assert queue.push(arriving) is arriving
    assert sorted(r.handle for r in queue) == ["heavy0", "heavy1", "heavy2", "light0"]


def test_a_new_tenant_arriving_at_a_full_queue_displaces_the_heaviest():
    queue = FairQueue(4)
    fill(queue, "a", 2)
    fill(queue, "b", 2)
    assert queue.push(request("c", name="c0")).handle in {"a1", "b1"}
    assert "c0" in {r.handle for r in queue}


def test_at_equal_shares_the_arriving_request_is_the_one_refused():
    """The newest of the tenants holding the most: nobody's queued request is displaced for it."""
    queue = FairQueue(3)
    fill(queue, "a", 2)
    fill(queue, "b", 1)
    arriving = request("b", name="b-late")
    assert queue.push(arriving) is arriving
    assert sorted(r.handle for r in queue) == ["a0", "a1", "b0"]


def test_shares_are_judged_for_weight():
    queue = FairQueue(4)
    fill(queue, "gold", 2, weight=3)
    fill(queue, "plain", 2, weight=1)
    assert queue.push(request("gold", weight=3, name="gold-late")).handle == "plain1"
    arriving = request("plain", name="plain-late")
    assert queue.push(arriving) is arriving


def test_the_least_urgent_priority_is_shed_first_even_when_another_tenant_floods():
    queue = FairQueue(4)
    fill(queue, "flood", 3, priority=STANDARD)
    fill(queue, "quiet", 1, priority=BATCH)
    assert queue.push(request("flood", STANDARD, name="flood-late")).handle == "quiet0"
    assert [queue.depth(p) for p in Priority] == [0, 4, 0]


def test_an_arrival_less_urgent_than_everything_queued_is_refused():
    queue = FairQueue(2)
    fill(queue, "s", 2, priority=STANDARD)
    arriving = request("new", BATCH)
    assert queue.push(arriving) is arriving
    assert len(queue) == 2


def test_a_more_urgent_arrival_sheds_a_less_urgent_queued_request():
    queue = FairQueue(3)
    fill(queue, "b", 3, priority=BATCH)
    assert queue.push(request("s", STANDARD, name="urgent")).handle == "b2"
    assert drain(queue) == ["urgent", "b0", "b1"]


def test_critical_requests_are_shed_last():
    queue = FairQueue(4)
    fill(queue, "gold", 2, priority=CRITICAL)
    fill(queue, "plain", 2, priority=STANDARD)
    assert queue.push(request("gold", CRITICAL, name="gold-late")).handle == "plain1"
    assert queue.push(request("gold", CRITICAL, name="gold-later")).handle == "plain0"
    assert [queue.depth(p) for p in Priority] == [4, 0, 0]
    arriving = request("plain", STANDARD)
    assert queue.push(arriving) is arriving
    arriving = request("gold", CRITICAL)
    assert queue.push(arriving) is arriving  # gold holds all four: its own newest goes
    assert queue.push(request("other", CRITICAL, name="other0")).handle == "gold-later"


def test_an_arriving_continuation_displaces_its_own_tenants_newest_new_work():
    queue = FairQueue(3)
    queue.push(request("a", name="a-new0"))
    queue.push(request("a", name="a-new1"))
    queue.push(request("b", name="b0"))
    assert queue.push(request("a", name="a-step2", step=2)).handle == "a-new1"
    assert drain(queue) == ["a-step2", "b0", "a-new0"]


def test_an_arriving_continuation_does_not_displace_an_older_continuation():
    queue = FairQueue(3)
    queue.push(request("a", name="a-step2", step=2))
    queue.push(request("a", name="a-step3", step=3))
    queue.push(request("b", name="b0"))
    arriving = request("a", name="a-step4", step=4)
    assert queue.push(arriving) is arriving
    assert sorted(r.handle for r in queue) == ["a-step2", "a-step3", "b0"]


def test_new_work_of_the_heaviest_tenant_is_shed_before_its_continuations():
    queue = FairQueue(4)
    queue.push(request("a", name="a-new"))
    queue.push(request("a", name="a-step2", step=2))
    queue.push(request("a", name="a-step3", step=3))
    queue.push(request("b", name="b0"))
    assert queue.push(request("c", name="c0")).handle == "a-new"
    assert queue.push(request("d", name="d0")).handle == "a-step3"


def test_a_shed_request_is_gone_from_the_queue():
    queue = FairQueue(2)
    fill(queue, "b", 2, priority=BATCH)
    shed = queue.push(request("c", CRITICAL, name="c0"))
    assert not queue.remove(shed)
    assert drain(queue) == ["c0", "b0"]


@pytest.mark.parametrize("max_size", [0, -1], ids=["zero", "negative"])
def test_a_queue_holds_at_least_one(max_size):
    with pytest.raises(ValueError, match="max_size must be >= 1"):
        FairQueue(max_size)


def test_a_tenant_is_under_its_share_while_it_goes_ahead_of_the_others_on_credit():
    queue = FairQueue(1000)
    assert not queue.under_share("new", STANDARD)  # nobody else waits
    fill(queue, "busy", 100)
    assert not queue.under_share("new", STANDARD)  # both would start with the same credit
    drain(queue, 20)
    assert queue.under_share("new", STANDARD)  # busy has spent its credit: new would go turns ahead
    assert not queue.under_share("busy", STANDARD)  # nobody else waits
    fill(queue, "light", 3)
    assert queue.under_share("light", STANDARD) and not queue.under_share("busy", STANDARD)
    assert drain(queue, 3) == ["light0", "light1", "light2"]
    fill(queue, "light", 20)
    drain(queue, 20)
    assert not queue.under_share("light", STANDARD)  # its credit spent: the two take turns
