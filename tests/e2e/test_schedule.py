"""The e2e runs' scheduler (tests.e2e.runner.schedule): at most ``parallel`` runs at once, a replaying run only after
its recording run has finished, every run once. Runs in the main suite (no verl, no subprocess)."""

import threading
import time

import pytest

from tests.e2e.runner import recordings_first, schedule

HANG_GUARD_S = 60
RECORDS = {"zorro": "stock", "zorro_lora": "stock_lora"}


def _trace(names, parallel, durations, poll_s=2.0):
    """Runs the scheduler on sleeping stand-ins; returns ``(kind, name, live runs)`` in event order."""
    lock, live, events = threading.Lock(), [0], []

    def start(name):
        with lock:
            live[0] += 1
            events.append(("start", name, live[0]))
        time.sleep(durations.get(name, 0.01))
        with lock:
            live[0] -= 1
            events.append(("end", name, live[0]))

    schedule(names, parallel, start, RECORDS.get, poll_s=poll_s)
    return events


@pytest.mark.parametrize("parallel", [1, 2, 3])
def test_order_and_width(parallel):
    names = ["stock", "zorro", "zorro_v0", "stock_lora", "zorro_lora"]
    # the recording runs are the slow ones: their replays must wait although slots are free
    events = _trace(names, parallel, {"stock": 0.2, "stock_lora": 0.15})
    starts = [n for kind, n, _ in events if kind == "start"]
    assert sorted(starts) == sorted(names)  # each once
    assert max(k for kind, _, k in events if kind == "start") <= parallel  # (that it widens: the test below)
    for replay, record in RECORDS.items():
        end_rec = next(i for i, e in enumerate(events) if e[:2] == ("end", record))
        start_rep = next(i for i, e in enumerate(events) if e[:2] == ("start", replay))
        assert end_rec < start_rep, (replay, events)


def test_recorder_not_selected_and_errors():
    # a replay whose recording run is not selected starts at once (it reads a recording left by an earlier session)
    assert [n for kind, n, _ in _trace(["zorro"], 2, {}) if kind == "start"] == ["zorro"]

    def boom(name):
        raise OSError(f"cannot start {name}")

    with pytest.raises(OSError, match="cannot start stock"):
        schedule(["stock", "zorro"], 2, boom, RECORDS.get)


def test_width_grows_while_runs_go():
    """A callable width is read again while runs go: one at a time until the flag is set (by the first run), then a
    second run starts beside the first, which waits for it (no timing: it fails by the guard if the width is never
    read again)."""
    flag, b_started, live, events = threading.Event(), threading.Event(), [0], []
    lock = threading.Lock()

    def start(name):
        with lock:
            live[0] += 1
            events.append((name, live[0]))
        if name == "a":
            flag.set()
            assert b_started.wait(HANG_GUARD_S), "the scheduler did not widen while a ran"
        elif name == "b":
            b_started.set()
        with lock:
            live[0] -= 1

    schedule(["a", "b", "c"], lambda: 2 if flag.is_set() else 1, start, RECORDS.get, poll_s=0.01)
    assert events[:2] == [("a", 1), ("b", 2)], events


def test_recordings_first():
    names = ["stock", "zorro", "zorro_v0", "stock_lora", "zorro_lora", "lonely"]
    rec = {"zorro": "stock", "zorro_v0": "stock", "zorro_lora": "stock_lora"}.get
    assert recordings_first(names, rec) == ["stock", "stock_lora", "zorro", "zorro_v0", "zorro_lora", "lonely"]
    assert recordings_first([], rec) == []
