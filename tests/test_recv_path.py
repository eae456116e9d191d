"""How many modules one recv crosses, from the public API to the wire (11: at
most 12) and back (16 in all).

The README's first pattern (the blocking ``rendezvous.Server``, gRPC, a tensor
produced before it is asked for) is traced with a profiler on the consumer's
threads only: the caller's and its server's loop thread. Every module of the
package whose code runs for one recv is counted. The list below is today's;
a module that joins the path fails this test until it is added here with a
reason (the count may only fall), so layers cannot pile up on the hot path
unnoticed.
"""

from __future__ import annotations

import concurrent.futures
import sys

import numpy as np
import pytest

from conftest import key, two_servers

pytestmark = pytest.mark.timeout(60)

#: module (under rendezvous/) -> what it does for one recv
PATH = {
    "rank/blocking.py": "the public call: hands the recv to the loop and waits",
    "rank/receiver.py": "routes the key (parsed once per key string): kept, local or remote; the stall watch; counts it",
    "rank/peers.py": "the producer's peer client; a step's abort ends its waits",
    "deadlines.py": "the recv's deadline on the server's one timer",
    "table.py": "whether the step was aborted",
    "stats.py": "counts the transfer by path",
    "rpc/peer.py": "the request id, the stream, asking again after a broken one",
    "rpc/consumer_stream.py": "the call on the stream: submit, read, dispatch, deliver",
    "rpc/delivery.py": "the call's state: asked, then settled",
    "rpc/grpc_calls.py": "the gRPC stream under the request-path contract",
    "transport/__init__.py": "the planes: the offer, and the one that reads the reply",
    "transport/inline.py": "the inline plane: the reply's tensor as a view on the message",
    "codec/requests.py": "the request, written by hand",
    "codec/parsing.py": "the reply split into frames, the tensor decoded in place",
    "codec/tensors.py": "the tensor's dtype and shape, checked",
    "codec/wire.py": "protobuf's field walk",
}


#: the modules that run from the public call until its request is written
#: (``codec/requests.py`` made it): "from the public API to the wire"
DOWN = ["rank/blocking.py", "rank/receiver.py", "table.py", "rank/peers.py", "rpc/peer.py",
        "transport/__init__.py", "rpc/delivery.py", "deadlines.py", "rpc/consumer_stream.py",
        "codec/requests.py", "codec/wire.py"]


def _modules_of_one_recv() -> tuple[set[str], list[str]]:
    """(every module one recv runs, those that ran until its request was made, in order)."""
    seen: set[str] = set()
    down: list[str] = []
    made = [False]  # the request is made: what runs from then on is not on the way down

    def profile(frame, event, arg):
        if event in ("call", "return"):
            name = frame.f_code.co_filename
            if "/rendezvous/" in name and "/rendezvous/v1/" not in name:
                module = name.rsplit("/rendezvous/", 1)[1]
                seen.add(module)
                if not made[0] and module not in down:
                    down.append(module)
                made[0] = made[0] or (event == "return" and module == "codec/requests.py")

    def on_loop(server, what) -> None:
        done: concurrent.futures.Future = concurrent.futures.Future()
        server._loop.call_soon_threadsafe(lambda: (sys.setprofile(what), done.set_result(None)))
        done.result(10)

    with two_servers() as (consumer, producer):
        k = key(1, 0, "w")
        for step in range(6):
            producer.send(k, np.ones(256, np.float32), step_id=step)
        for step in range(5):  # connected, caches warm: what every later recv does
            consumer.recv(k, step_id=step, timeout=30)
        on_loop(consumer, profile)
        sys.setprofile(profile)
        try:
            got = consumer.recv(k, step_id=5, timeout=30)
        finally:
            sys.setprofile(None)
            on_loop(consumer, None)
        np.testing.assert_array_equal(got, np.ones(256, np.float32))
    return seen, down


def test_one_recv_crosses_only_the_modules_listed():
    seen, down = _modules_of_one_recv()
    assert down == DOWN, f"from the public call to the request made, one recv runs {down}"
    assert len(DOWN) <= 12
    joined = sorted(seen - set(PATH))
    assert not joined, f"modules joined one recv's path (add each to PATH with why, or keep them off it): {joined}"
    left = sorted(set(PATH) - seen)
    assert not left, f"no longer on one recv's path: remove from PATH {left}"
