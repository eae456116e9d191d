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

    reply = OutgoingReply(iter([b"frame"]), _Req(1, 0), "k", Received(1, False))
    assert not reply.started and not reply.committed
    reply.to(d.START)
    assert reply.started and "STARTED" in repr(reply)
    servicer = _Servicer(carried=set())
    reply.give_back(servicer, None)
    assert servicer.requeued == [(1, "k", Received(1, False))]
    with pytest.raises(d.IllegalMove, match="GIVE_BACK is not allowed in state GIVEN_BACK"):
        reply.give_back(servicer, None)
    assert len(servicer.requeued) == 1  # not twice


# -- the edges: ids in doubt, transfers cut off, tensors put back ---------------

def test_ids_in_doubt_are_asked_again_oldest_first_per_key_and_capped():
    doubt = d.InDoubt(limit=3)
    assert not doubt and doubt.take(1, "k") is None
    doubt.add(1, "k", 10)
    doubt.add(1, "k", 11)
    doubt.add(1, "k", 10)  # the same id twice is one id
    doubt.add(2, "k", 20)  # another step is another key
    assert len(doubt) == 3 and doubt.ids(1, "k") == [10, 11] and doubt.ids(2, "k") == [20]
    doubt.add(1, "j", 30)  # over the cap: the key left longest ago loses its oldest id
    assert len(doubt) == 3 and doubt.ids(1, "k") == [11]
    assert doubt.take(1, "k") == 11 and doubt.take(1, "k") is None
    assert doubt.take(2, "k") == 20 and doubt.take(1, "j") == 30
    assert not doubt and len(doubt) == 0


def test_a_cut_off_fails_only_the_calls_still_on_their_way():
    async def main():
        loop = asyncio.get_running_loop()
        landed = PendingCall(loop.create_future(), "a", 1)
        still = PendingCall(loop.create_future(), "b", 1)
        for p in (landed, still):
            p.to(d.MOVED)
        moving = {1: still}  # call 0 landed meanwhile: no longer moving
        d.cut_off(moving, [(0, landed), (1, still)], d.PeerUnavailable("stream to x broke"), waited=2.0)
        assert landed.delivery == d.MOVING and not landed.future.done()
        assert still.delivery == d.ORPHAN_MOVING  # what lands later is kept
        with pytest.raises(d.PeerUnavailable, match="'b' was on its way outside the stream and did not land "
                                                    "within 2s of its end; it is kept"):
            still.future.result()

    asyncio.run(main())


class _Retry:
    def __init__(self, carried: set[int]) -> None:
        self.carried = carried
        self.asked: list[tuple[int, object]] = []

    def cut_off(self, request_id: int, owner: object) -> bool:
        self.asked.append((request_id, owner))
        return request_id not in self.carried


class _Servicer:
    def __init__(self, carried: set[int]) -> None:
        self.retry = _Retry(carried)
        self.requeued: list[tuple[int, str, object]] = []

    def requeue(self, step_id: int, key: str, item: object) -> None:
        self.requeued.append((step_id, key, item))


class _Req:
    def __init__(self, step_id: int, request_id: int) -> None:
        self.step_id, self.request_id = step_id, request_id


def test_a_tensor_is_put_back_unless_a_retry_of_its_id_carries_it():
    s = _Servicer(carried={7})
    stream = object()
    d.put_back(s, _Req(1, 7), "a", "tensor a", stream)  # a retry on another stream has it: not twice
    d.put_back(s, _Req(1, 8), "b", "tensor b", stream)
    d.put_back(s, _Req(2, 0), "c", "tensor c", stream)  # no id: nothing can carry it, back it goes
    assert s.requeued == [(1, "b", "tensor b"), (2, "c", "tensor c")]
    assert s.retry.asked == [(7, stream), (8, stream)]
