"""How a sender that fails partway through a transfer tells its receiver.

A transfer is ``nbytes`` in messages of ``chunk`` bytes on one tag, in
order (:mod:`rendezvous.mpi.staging`). A GPU sender can fail after some of
them left: a device-to-host copy, or the producer's own work, reported an
error. It then still sends one message for every chunk it has not sent,
each *shorter* than that chunk: the first carries :data:`MAGIC` and the
reason (cut to fit), the others are empty. So

* every receive the receiver posted completes at once, and it learns at
  the first short message that the transfer failed, and why; it does not
  wait for bytes that will never come;
* no receive stays posted and no message stays queued on the tag, so a
  later transfer on the same tag matches its own messages.

A receiver checks each message's length (``Status.Get_count``) against
its chunk: :func:`short_message` is the error for one that is short. A
transfer of 0 bytes (one empty message) reads nothing from the device and
never aborts.
"""

from __future__ import annotations

import numpy as np

from rendezvous.errors import Aborted, Internal

__all__ = ["MAGIC", "SendAborted", "message", "short_message"]

#: what the first message of an aborted transfer starts with
MAGIC = b"\x00rendezvous-abort\x00"
#: bytes of the reason an abort message carries at most
REASON_BYTES = 1024
_EMPTY = np.empty(0, np.uint8)


class SendAborted(Internal):
    """A transfer its sender stopped before every data message was posted, its
    receiver told with short messages (see the module): the receiver cannot
    have the whole tensor, so nothing of it was delivered."""


def message(size: int, reason: str, first: bool) -> np.ndarray:
    """The abort message that stands for a chunk of ``size`` (> 0) bytes: the
    reason for the first one, else empty; always shorter than ``size``."""
    if not first:
        return _EMPTY
    data = MAGIC + reason.encode("utf-8", "replace")[:REASON_BYTES]
    return np.frombuffer(data[:size - 1], np.uint8)


def short_message(peer: int, tag: int, index: int, total: int, count: int, expected: int,
                  data: object) -> Aborted:
    """The receiver's error for message ``index`` (of ``total``) of a transfer from
    rank ``peer`` on ``tag``: ``count`` bytes came where ``expected`` were due. ``data`` is
    what was received, host memory (its first bytes say why), or None (it
    landed in device memory: not read)."""
    head = bytes(memoryview(data).cast("B")[:count]) if count and data is not None else b""  # type: ignore[arg-type]
    if head.startswith(MAGIC):
        why = head[len(MAGIC):].decode("utf-8", "replace") or "no reason given"
    else:
        why = f"a message of {count} bytes came where {expected} were due"
    return Aborted(f"rank {peer} gave up its transfer on MPI tag {tag} at message {index + 1} of {total}: {why}")
