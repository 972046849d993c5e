from __future__ import annotations

from kvpool.kv_events import SequenceTracker, Verdict


def test_first_message_sets_the_baseline_when_no_start_was_asked() -> None:
    t = SequenceTracker.starting_at(None)
    assert t.classify(41) is Verdict.NEXT
    t.consume(41)
    assert t.classify(42) is Verdict.NEXT
    assert t.classify(44) is Verdict.GAP


def test_a_start_sequence_makes_anything_later_a_gap() -> None:
    t = SequenceTracker.starting_at(0)
    assert t.expected == 0
    assert t.classify(0) is Verdict.NEXT
    assert t.classify(5) is Verdict.GAP


def test_live_messages_covered_by_a_replay_are_duplicates() -> None:
    t = SequenceTracker.starting_at(None)
    t.consume(10)
    for seq in range(11, 20):  # filled in by replay
        t.consume(seq, replayed=True)
    assert t.classify(15, live=True) is Verdict.DUPLICATE
    assert t.classify(19, live=True) is Verdict.DUPLICATE
    assert t.classify(20, live=True) is Verdict.NEXT


def test_a_step_backwards_outside_a_replay_is_a_restart() -> None:
    t = SequenceTracker.starting_at(None)
    for seq in range(0, 100):
        t.consume(seq)
    assert t.classify(3, live=True) is Verdict.RESTART
    t.restart()
    assert t.classify(0) is Verdict.NEXT
    assert t.classify(3) is Verdict.GAP


def test_once_live_passes_the_replayed_range_a_step_back_is_a_restart_again() -> None:
    t = SequenceTracker.starting_at(0)
    for seq in range(0, 50):
        t.consume(seq, replayed=True)  # catch-up replay at start
    assert t.classify(3, live=True) is Verdict.DUPLICATE
    t.consume(50)  # first live message past the replay
    assert t.classify(3, live=True) is Verdict.RESTART


def test_replayed_messages_below_the_position_are_duplicates_not_restarts() -> None:
    t = SequenceTracker.starting_at(None)
    t.consume(30)
    assert t.classify(12, live=False) is Verdict.DUPLICATE
