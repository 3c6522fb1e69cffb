"""serve_turns: whose turn it is on the server's engine (stopped, overdue, smallest remaining budget,
least service, arrival), and the starvation bound it gives, on hand-made jobs."""

from dataclasses import dataclass

from viasd_core.frontends.serve_turns import PATIENCE, priority, took_turn, turn_order


@dataclass(eq=False)
class J:
    name: str
    budget: int
    tokens: int = 0
    service: float = 0.0
    waited: int = 0
    seq: int = 0
    reason: str | None = None


def names(jobs):
    return [j.name for j in turn_order(jobs)]


def test_a_newcomer_with_a_smaller_budget_goes_before_a_running_long_one():
    long = J("long", budget=128, tokens=40, service=2.0, seq=0)
    short = J("short", budget=16, seq=1)
    assert names([long, short]) == ["short", "long"]
    # the budget left counts, not the one asked for: a long answer near its end goes first
    assert names([J("long", 128, tokens=120, service=3.0), J("short", 16, seq=1)]) == ["long", "short"]


def test_equal_budgets_go_by_least_service_then_arrival():
    a, b, c = J("a", 4096, service=1.5, seq=0), J("b", 4096, service=0.0, seq=2), J("c", 4096, service=0.0, seq=1)
    assert names([a, b, c]) == ["c", "b", "a"]
    assert priority(a) == (4096, 1.5, 0)


def test_stopped_jobs_then_overdue_ones_go_first():
    fresh = J("fresh", 16, seq=3)
    late = J("late", 4096, waited=PATIENCE + 5, seq=0)
    later = J("later", 4096, waited=PATIENCE + 9, seq=1)
    stopped = J("stopped", 4096, seq=2, reason="abort")
    assert names([fresh, late, later, stopped]) == ["stopped", "later", "late", "fresh"]
    assert names([fresh, J("almost", 4096, waited=PATIENCE - 1)]) == ["fresh", "almost"]


def test_no_job_waits_longer_than_the_bound_under_a_stream_of_short_newcomers():
    """One long job and two clients sending 2-step requests with smaller budgets back to back, so a
    newcomer always has a better priority than the long job: it still takes a step at least every
    PATIENCE + 1 steps (one other overdue job at most: the others never wait that long), and ends."""
    long = J("long", budget=400, seq=0)
    jobs, seq, longest, steps = [long], 1, {}, 0
    for c in range(2):
        jobs.append(J(f"s{c}", budget=8, seq=seq))
        seq += 1
    while long in jobs:
        job = turn_order(jobs)[0]
        longest[job.name[:1]] = max(longest.get(job.name[:1], 0), job.waited)
        job.tokens += 4
        job.service += 0.01
        took_turn(jobs, job)
        steps += 1
        if job.tokens >= job.budget:
            jobs.remove(job)
            if job is not long:  # its client's next request arrives at once
                jobs.append(J(job.name, budget=8, seq=seq))
                seq += 1
    assert longest["l"] == PATIENCE  # it did wait for newcomers, and exactly as long as allowed
    assert longest["s"] <= PATIENCE + 1
    assert steps <= 100 * (PATIENCE + 1) + 100  # 100 long steps, each after at most PATIENCE short ones (+ a few)
    # without the bound the long job never ran: the newcomers always came first
    starving = [J("long", 400, seq=0), J("s0", 8, seq=1)]
    for _ in range(3 * PATIENCE):
        job = turn_order(starving, patience=10**9)[0]
        assert job.name != "long"
        job.tokens += 4
        took_turn(starving, job)
        if job.tokens >= job.budget:
            starving.remove(job)
            starving.append(J("s0", 8, seq=job.seq + 1))
