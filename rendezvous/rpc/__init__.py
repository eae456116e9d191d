"""The gRPC control plane of a rank: :mod:`.servicer` (the producer side of
RecvTensor), :mod:`.peer` (RecvFromRemoteAsync, the consumer side),
:mod:`.retry` (answers by request_id), :mod:`.admin` (Stats, Pending and
health, for operators) and :mod:`.options` (service names and channel and
server settings, in one place). It knows nothing of which data
plane carries a tensor: that is :mod:`rendezvous.transport`'s."""
