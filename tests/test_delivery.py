"""A consumer's call as named states (rendezvous/rpc/delivery.py): the table of
moves, and the call object that follows it."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous.rpc import delivery as d
from rendezvous.rpc.consumer_stream import Pending

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
    p = Pending(asyncio.Future(loop=asyncio.new_event_loop()), "k", 3, request_id=7)
    assert not p.orphan and not p.settled and "ASKED" in repr(p)
    p.to(d.MOVED)
    p.to(d.GAVE_UP)
    assert p.orphan and not p.settled and "ORPHAN_MOVING" in repr(p)
    p.to(d.ANSWERED)
    assert p.settled and not p.orphan
    with pytest.raises(d.IllegalMove, match="'k' of step 3"):
        p.to(d.ANSWERED)  # answered twice: a bug, never handled
