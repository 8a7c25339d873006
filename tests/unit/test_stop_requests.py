"""Stop requests (vldist/training/stopping.py)."""

import os
import signal
import time

import pytest

from vldist.training import stopping
from vldist.training.stopping import (
    StopRequest,
    interrupts_deferred,
    raise_if_interrupted,
    signal_numbers,
    stop_requests,
)


def test_signal_names_with_or_without_sig_and_unknown_ones_refused():
    assert signal_numbers(["SIGTERM", "usr1", "SIGUSR2"]) == [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2]
    with pytest.raises(ValueError, match="'SIGFOO' is not a signal name"):
        signal_numbers(["SIGFOO"])


def test_ctrl_c_inside_a_deferred_block_raises_when_the_block_ends_and_is_not_lost(monkeypatch):
    monkeypatch.setattr(stopping, "_interrupted", False)
    # Python's own handler, whatever an earlier test in this process left (a run stopped by SIGINT
    # leaves it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)  # Python runs the handler at the next bytecode
            finished.append("the rest of the block ran")
    assert finished == ["the rest of the block ran"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # had that KeyboardInterrupt been dropped (raised in a finalizer), the next check raises it
    with pytest.raises(KeyboardInterrupt):
        raise_if_interrupted()


def test_a_block_without_ctrl_c_or_with_sigint_as_a_stop_signal_is_left_alone(monkeypatch):
    monkeypatch.setattr(stopping, "_interrupted", False)
    with interrupts_deferred():
        pass
    raise_if_interrupted()  # nothing pending
    try:
        with stop_requests(["SIGINT"]) as stop:
            with interrupts_deferred():
                signal.raise_signal(signal.SIGINT)  # the stop handler records it; no KeyboardInterrupt
            assert stop.requested and stop.reason == "SIGINT"
        raise_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a stopped run leaves it ignored


def test_an_unknown_signal_in_the_job_is_a_config_error():
    from vldist.errors import ConfigError
    from vldist.recipes.jobs import load_config

    with pytest.raises(ConfigError, match="train.stop_signals.*'SIGFOO' is not a signal name"):
        load_config("vsrn", ["train.stop_signals=[SIGTERM,SIGFOO]"])


def test_a_signal_is_recorded_a_second_is_acknowledged_and_handlers_come_back(capfd):
    before = signal.getsignal(signal.SIGUSR1)
    with stop_requests(["SIGUSR1"]) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.reason == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGUSR1)  # still alive: the second one is only acknowledged
        assert stop.reason == "SIGUSR1"
        # a stop was requested: on leaving, the process is on its way out and keeps ignoring it
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    signal.signal(signal.SIGUSR1, before)
    err = capfd.readouterr().err
    assert "SIGUSR1 received: finishing this step" in err and "received again: already stopping" in err
    with stop_requests(["SIGUSR1"]) as stop:
        pass
    assert signal.getsignal(signal.SIGUSR1) == before  # no stop: the previous handler is back


def test_a_forked_child_ignores_the_inherited_handler():
    """Data-loader workers are forked from the trainer with its handler; a group-wide SIGTERM must
    neither kill them nor count as their own stop."""
    with stop_requests(["SIGTERM"]) as stop:
        pid = os.fork()
        if pid == 0:  # the child: survive our own SIGTERM, then exit 0 only if nothing was recorded
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            os._exit(0 if stop.reason is None else 3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert not stop.requested


def test_the_watch_is_asked_at_most_once_a_second_and_its_reason_kept():
    asked = []

    def watch():  # as a Ray worker asks its driver's board
        asked.append(1)
        return "SIGTERM (relayed by the Ray driver)" if len(asked) > 1 else None

    stop = StopRequest(watch=watch)
    assert not stop.requested and len(asked) == 1
    assert not stop.requested and len(asked) == 1  # looked less than a second ago
    stop._next_look = 0.0
    assert stop.requested and stop.reason == "SIGTERM (relayed by the Ray driver)" and len(asked) == 2
    stop._next_look = 0.0
    assert stop.requested and len(asked) == 2  # a request stays: the watch is not asked again
