"""A consumer's call as named states (rendezvous/rpc/delivery.py): the table of
moves, and the call object that follows it."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous.rpc import delivery as d
from rendezvous.rpc.consumer_stream import PendingCall

pytestmark = pytest.mark.timeout(10)


def test_every_state_and_event_has_a_name_and_the_table_names_only_them():
    assert len(d.STATES) == 6 and len(d.EVENTS) == 4
    for (state, event), nxt in d.MOVES.items():
        assert 0 <= state < len(d.STATES) and 0 <= event < len(d.EVENTS) and 0 <= nxt < len(d.STATES)


def test_the_moves_the_table_allows_and_no_other():
    for state in range(len(d.STATES)):
        for event in range(len(d.EVENTS)):
            if (state, event) in d.MOVES:
                assert d.after(state, event) == d.MOVES[state, event]
            else:
                with pytest.raises(d.IllegalMove, match=f"{d.EVENTS[event]} is not allowed in state {d.STATES[state]}"):
                    d.after(state, event)


def test_an_answer_and_a_break_are_final():
    """Nothing moves a call on once its answer is in (a second answer would be a
    tensor delivered twice) or once it is in doubt (its id is the next recv's)."""
    for final in (d.SETTLED, d.IN_DOUBT):
        assert not [e for e in range(len(d.EVENTS)) if (final, e) in d.MOVES]


def test_every_state_but_the_final_ones_can_be_answered():
    """No call can be stranded: from every live state an answer settles it."""
    for state in (d.ASKED, d.MOVING, d.ORPHAN, d.ORPHAN_MOVING):
        assert d.after(state, d.ANSWERED) == d.SETTLED


def test_bytes_on_their_way_are_never_in_doubt():
    """A call whose bytes are on their way outside the stream is not failed by
    its stream's end: it lands (or is cut off, as an orphan), never asked again."""
    for state in (d.MOVING, d.ORPHAN_MOVING):
        with pytest.raises(d.IllegalMove):
            d.after(state, d.BROKE)


def test_a_call_follows_the_table_and_says_where_it_stands():
    p = PendingCall(asyncio.Future(loop=asyncio.new_event_loop()), "k", 3, request_id=7)
    assert not p.orphan and not p.settled and "ASKED" in repr(p)
    p.to(d.MOVED)
    p.to(d.GAVE_UP)
    assert p.orphan and not p.settled and "ORPHAN_MOVING" in repr(p)
    p.to(d.ANSWERED)
    assert p.settled and not p.orphan
    with pytest.raises(d.IllegalMove, match="'k' of step 3"):
        p.to(d.ANSWERED)  # answered twice: a bug, never handled


def test_a_reply_is_given_back_at_most_once_and_only_before_it_is_written_whole():
    """A producer's reply (delivery.REPLY_MOVES): committed and started replies
    stay so; giving one back is final, so its tensors can never go back to the
    table twice (that would deliver them twice)."""
    for state in range(len(d.REPLY_STATES)):
        for event in range(len(d.REPLY_EVENTS)):
            if (state, event) in d.REPLY_MOVES:
                d.reply_after(state, event)
            else:
                with pytest.raises(d.IllegalMove):
                    d.reply_after(state, event)
    assert not [e for e in range(len(d.REPLY_EVENTS)) if (d.GIVEN_BACK, e) in d.REPLY_MOVES]
    for state in (d.READY, d.COMMITTED, d.STARTED, d.COMMITTED_STARTED):
        assert d.reply_after(state, d.GIVE_BACK) == d.GIVEN_BACK
    assert d.reply_after(d.COMMITTED, d.START) == d.COMMITTED_STARTED
    with pytest.raises(d.IllegalMove):
        d.reply_after(d.STARTED, d.COMMIT)  # a transfer starts only with its descriptor's first frame


def test_a_reply_object_follows_the_table():
    from rendezvous.items import Received
    from rendezvous.rpc.delivery import OutgoingReply

    class Servicer:
        back: list = []

        def put_back(self, req, key, item, stream):
            self.back.append(item)

    reply = OutgoingReply(iter([b"frame"]), None, "k", Received(1, False))
    assert not reply.started and not reply.committed
    reply.to(d.START)
    assert reply.started and "STARTED" in repr(reply)
    servicer = Servicer()
    reply.give_back(servicer, None)
    assert servicer.back == [Received(1, False)]
    with pytest.raises(d.IllegalMove, match="GIVE_BACK is not allowed in state GIVEN_BACK"):
        reply.give_back(servicer, None)
    assert servicer.back == [Received(1, False)]  # not twice
