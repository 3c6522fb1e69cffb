"""serve_turns: whose turn it is on the server's engine (stopped, then the earliest deadline: the
step a request was taken at plus the budget it has left, least service, arrival), and the bound on
waiting that gives, on hand-made jobs."""

from dataclasses import dataclass

from viasd_core.frontends.serve_turns import AGING, GRACE, expected, priority, turn_order


@dataclass(eq=False)
class J:
    name: str
    budget: int
    tokens: int = 0
    service: float = 0.0
    born: int = 0
    seq: int = 0
    reason: str | None = None
    binds: bool = True


def names(jobs):
    return [j.name for j in turn_order(jobs)]


def test_a_newcomer_with_a_smaller_budget_goes_before_a_running_long_one():
    long = J("long", budget=128, tokens=40, service=2.0, seq=0)
    short = J("short", budget=16, born=5, seq=1)
    assert names([long, short]) == ["short", "long"]
    # the budget left counts, not the one asked for: a long answer near its end goes first
    assert names([J("long", 128, tokens=120, service=3.0), J("short", 16, born=5, seq=1)]) == ["long", "short"]


def test_waiting_earns_priority_at_the_aging_rate():
    """A request taken d steps later is ahead only while its budget left is AGING * d below."""
    old = J("old", 128, born=0, seq=0)
    d = 500
    assert names([old, J("new", 128 - int(AGING * d) + 1, born=d, seq=1)]) == ["old", "new"]
    assert names([old, J("new", 128 - int(AGING * d) - 1, born=d, seq=1)]) == ["new", "old"]
    assert priority(old) == (128, 0.0, 0)


def test_without_a_binding_budget_the_least_served_goes_first_and_such_requests_share():
    """No max_tokens (the context's end bounds it): expected need = tokens produced + GRACE, so a
    newcomer goes first and two such requests take turns instead of one running to its end."""
    a = J("a", 4000, tokens=0, binds=False, seq=0)
    b = J("b", 4000, tokens=0, born=1, binds=False, seq=1)
    assert expected(a) == GRACE
    runs = []
    for _ in range(40):
        job = turn_order([a, b])[0]
        job.tokens += 2
        runs.append(job.name)
    assert runs.count("a") == runs.count("b") == 20
    assert abs(a.tokens - b.tokens) <= 2
    # a bounded request with a small budget left goes before a fresh unbounded one
    assert names([J("free", 4000, binds=False), J("bounded", 8, born=3, seq=1)]) == ["bounded", "free"]


def test_equal_budgets_go_by_least_service_then_arrival():
    a, b, c = J("a", 4096, service=1.5, seq=0), J("b", 4096, service=0.0, seq=2), J("c", 4096, service=0.0, seq=1)
    assert names([a, b, c]) == ["c", "b", "a"]


def test_stopped_jobs_go_first_in_arrival_order():
    fresh = J("fresh", 16, seq=3)
    big = J("big", 4096, seq=0)
    stopped = J("stopped", 4096, seq=2, reason="abort")
    timed = J("timed", 4096, seq=1, reason="timeout")
    assert names([fresh, big, stopped, timed]) == ["timed", "stopped", "fresh", "big"]


def test_a_long_request_under_a_stream_of_short_newcomers_waits_a_bounded_time_and_then_runs():
    """One long job and two clients sending 2-step requests with smaller budgets back to back, so a
    newcomer always has a smaller budget: the long job waits at most budget / AGING steps and then
    runs on without interruption (not one step in N), so it ends."""
    long = J("long", budget=400, seq=0)
    jobs, seq, steps, long_steps, first_long = [long], 1, 0, [], None
    for c in range(2):
        jobs.append(J(f"s{c}", budget=8, seq=seq))
        seq += 1
    while long in jobs:
        job = turn_order(jobs)[0]
        job.tokens += 4
        job.service += 0.01
        if job is long:
            long_steps.append(steps)
        steps += 1
        if job.tokens >= job.budget:
            jobs.remove(job)
            if job is not long:  # its client's next request arrives at once
                jobs.append(J(job.name, budget=8, born=steps, seq=seq))
                seq += 1
    assert long_steps[0] > 0  # it did wait for the newcomers
    assert long_steps[0] <= 400 / AGING
    assert long_steps == list(range(long_steps[0], long_steps[0] + 100))  # then 100 steps in a row
