"""Mailboxes: a message per (step, key), taken once; abort, lost peer or timeout ends a wait."""

from __future__ import annotations

import threading

import pytest

from pipeline.step.mail import AbortedError, Mailboxes, MailTimeoutError, Message


def taking(
    boxes: Mailboxes, step: int, key: str, sender: int | None = None
) -> tuple[threading.Thread, list[object]]:
    """A thread taking (step, key); what it took, or the error it got, lands in the list."""
    got: list[object] = []

    def take() -> None:
        try:
            got.append(boxes.take(step, key, f"the message {key!r}", sender))
        except Exception as error:
            got.append(error)

    thread = threading.Thread(target=take)
    thread.start()
    return thread, got


def test_a_take_waits_for_the_put_of_its_key() -> None:
    boxes = Mailboxes()
    thread, got = taking(boxes, 1, "act")
    message = Message([1.0])
    boxes.put(1, "act", message)
    thread.join(30)
    assert not thread.is_alive() and got == [message]


def test_each_message_is_taken_once_and_steps_do_not_mix() -> None:
    boxes = Mailboxes(timeout=0.01)
    first, second = Message(["first"]), Message(["second"])
    boxes.put(1, "act", first)
    boxes.put(2, "act", second)
    assert boxes.take(2, "act", "step 2's") is second
    assert boxes.take(1, "act", "step 1's") is first
    with pytest.raises(MailTimeoutError, match=r"waited 0\.01 s for step 1's again, in vain"):
        boxes.take(1, "act", "step 1's again")


def test_an_abort_ends_the_waits_of_its_step_with_the_reason_and_spares_the_next_step() -> None:
    boxes = Mailboxes()
    later = Message(["later"])
    boxes.put(2, "act", later)
    thread, got = taking(boxes, 1, "grad")
    boxes.abort(1, KeyError("failed in forward"))
    thread.join(30)
    assert not thread.is_alive() and len(got) == 1 and isinstance(got[0], AbortedError)
    assert "gave up waiting for the message 'grad': 'failed in forward'" in str(got[0])
    with pytest.raises(AbortedError, match="stopped: 'failed in forward'"):
        boxes.check(1)
    boxes.check(2)
    assert boxes.take(2, "act", "the next step's") is later


def test_the_first_reason_of_a_step_stays() -> None:
    boxes = Mailboxes()
    boxes.abort(1, ValueError("first"))
    boxes.abort(1, ValueError("second"))
    with pytest.raises(AbortedError, match="stopped: first"):
        boxes.check(1)


def test_a_new_step_forgets_what_earlier_steps_left() -> None:
    boxes = Mailboxes(timeout=0.01)
    boxes.put(1, "act", Message(["stale"]))
    boxes.abort(1, RuntimeError("failed"))
    boxes.begin(2)
    boxes.check(1)  # step 1's abort is forgotten with its messages
    with pytest.raises(MailTimeoutError):
        boxes.take(1, "act", "the stale message")


def test_a_lost_peer_ends_every_wait_of_every_step() -> None:
    boxes = Mailboxes()
    thread, got = taking(boxes, 3, "act")
    boxes.break_down(ConnectionError("lost the connection to rank 1"))
    thread.join(30)
    assert isinstance(got[0], AbortedError) and "lost the connection to rank 1" in str(got[0])
    with pytest.raises(AbortedError, match="lost the connection"):
        boxes.check(7)


def test_a_sender_that_stopped_ends_the_waits_for_what_it_did_not_send_only() -> None:
    boxes = Mailboxes()
    sent = Message(["sent before its stop"])
    boxes.put(1, "act", sent)
    waiting, got = taking(boxes, 1, "grad", sender=1)
    elsewhere, got_elsewhere = taking(boxes, 1, "skip", sender=2)
    boxes.stopped(1, ConnectionError("rank 1 closed its pipeline"))
    waiting.join(30)
    assert isinstance(got[0], AbortedError) and "rank 1 closed its pipeline" in str(got[0])
    assert boxes.take(1, "act", "what rank 1 sent", sender=1) is sent
    assert elsewhere.is_alive(), "a wait on another sender ended"
    boxes.put(1, "skip", Message(["from rank 2"]))
    elsewhere.join(30)
    assert not elsewhere.is_alive() and isinstance(got_elsewhere[0], Message)
