"""The watchdog's judgements, from heartbeat records written out by hand: who stopped a hung run,
who is the straggler; and the heartbeat's own-time accounting (a rank's forward outside the
collectives in it, plus its data wait)."""

import time

from vldist.distributed.heartbeat import Heartbeat
from vldist.distributed.watchdog import Watchdog, describe_hang, find_straggler


def record(rank, step=7, phase="collective all_reduce (loss)", seq=1, own=None, data_wait=0.0, reporting=False):
    return {
        "rank": rank,
        "host": f"node{rank}",
        "pid": 100 + rank,
        "step": step,
        "phase": phase,
        "seq": seq,
        "own": own,
        "data_wait": data_wait,
        "reporting": reporting,
    }


def test_a_rank_whose_heartbeat_stopped_is_named_and_the_waiting_ones_listed():
    before = {0: record(0, seq=10), 1: record(1, phase="forward (main)", seq=4)}
    after = {0: record(0, seq=12, reporting=True), 1: record(1, phase="forward (main)", seq=4)}
    said = describe_hang(before, after, 2)
    assert said.startswith(
        "rank 1 on node1 (pid 101) stopped responding, last at step 7 in forward (main); "
        "waiting for it: rank 0 on node0 (pid 100) at step 7 in collective all_reduce (loss)"
    )


def test_a_reporting_rank_is_alive_even_if_its_heartbeat_did_not_move():
    """Two ranks that both noticed the hang report at once; neither is the one that stopped."""
    before = {r: record(r, seq=5, reporting=True) for r in range(3)}
    after = {r: record(r, seq=5, reporting=True) for r in range(2)} | {2: record(2, phase="data", seq=5)}
    said = describe_hang(before, after, 3)
    assert said.startswith("rank 2 on node2 (pid 102) stopped responding, last at step 7 in data")
    assert "rank 0 on node0" in said and "rank 1 on node1" in said


def test_with_every_heartbeat_alive_the_rank_outside_a_collective_is_stuck():
    before = {0: record(0, seq=1), 1: record(1, phase="data", step=6, seq=1)}
    after = {0: record(0, seq=3), 1: record(1, phase="data", step=6, seq=3)}
    said = describe_hang(before, after, 2)
    assert said.startswith("rank 1 on node1 (pid 101) is stuck at step 6 in data; waiting for it: rank 0")


def test_all_in_collectives_names_the_lowest_step_and_a_silent_rank_is_listed():
    before = {0: record(0, step=9, seq=1), 1: record(1, step=8, seq=1)}
    after = {0: record(0, step=9, seq=2), 1: record(1, step=8, seq=2)}
    said = describe_hang(before, after, 3)
    assert said.startswith("rank 1 on node1 (pid 101) is stuck at step 8")
    assert said.endswith("never reported: rank 2.")


def test_the_straggler_is_the_rank_far_above_the_others_median():
    records = {
        0: record(0, own=0.10),
        1: record(1, own=0.11),
        2: record(2, own=0.35, data_wait=0.2),
        3: record(3, own=0.09),
    }
    rank, said = find_straggler(records, 1.5)
    assert rank == 2
    assert said == (
        "rank 2 on node2 takes 3.5x the other ranks' median step (0.35 s against 0.10 s, 0.20 s of it data wait)"
    )
    assert find_straggler(records, 3.6) is None  # under the ratio
    assert find_straggler({0: record(0, own=0.1), 1: record(1, own=None)}, 1.5) is None  # no time yet


def test_own_time_is_the_forward_outside_its_collectives_plus_the_data_wait():
    hb = Heartbeat()
    hb.step_started()
    with hb.phase_of("forward (main)"):
        time.sleep(0.05)
        with hb.collective("all_reduce"):
            assert hb.phase == "collective all_reduce"
            time.sleep(0.10)  # waiting for the others: not this rank's own time
    with hb.phase_of("backward (main)"):
        time.sleep(0.05)  # DDP's all-reduce hides in here: left out
    assert hb.phase == "starting"
    hb.step_done(1, seconds=0.2, data_wait=0.03)
    assert 0.05 <= hb.last.forward < 0.09
    assert hb.last.own == hb.last.forward + 0.03
    assert hb.window_mean().own == hb.last.own
    assert hb.window_mean().own == hb.last.own  # no step since: the last window stays


def test_a_single_process_watchdog_reports_its_own_phase_when_nothing_advances():
    hb, said = Heartbeat(), []
    hb.phase = "data"
    dog = Watchdog(
        hb, None, 0, 1, hang_timeout_s=0.5, straggler_ratio=None, resume_hint="resume hint.", on_hang=said.append
    ).start()
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert said and said[0].startswith("error: no rank of the run advanced for ")
    assert "rank 0 on" in said[0] and "is in data at step 0" in said[0] and "resume hint." in said[0]


def test_progress_keeps_the_watchdog_quiet():
    hb, said = Heartbeat(), []
    dog = Watchdog(
        hb, None, 0, 1, hang_timeout_s=0.5, straggler_ratio=None, resume_hint="", on_hang=said.append
    ).start()
    for step in range(1, 25):  # a step every 0.05 s for 1.2 s: longer than the timeout
        time.sleep(0.05)
        hb.step_done(step, 0.05, 0.0)
    dog.stop()
    assert said == []
