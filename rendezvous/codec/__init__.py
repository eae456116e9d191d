"""The wire codec: TensorFlow's messages and this package's own, written and
read by hand so that a tensor's bytes are never re-serialized.

- :mod:`.fields`, :mod:`.wire`: field numbers, varints, field walks, padding, gathered frames
- :mod:`.dtypes`, :mod:`.tensors`: the dtypes that travel; ``TensorProto`` by hand, sizes checked first
- :mod:`.requests`: the consumer's StreamRequests (a recv, many, a cancel, a batch)
- :mod:`.replies`: the producer's replies and stream frames
- :mod:`.parsing`: replies split into frames and parts as the consumer reads them
- :mod:`.assembly`: a chunked reply put together
- :mod:`.groups`: group replies (many tensors in one frame or fusion buffer)
- :mod:`.allocator`: allocator tuning for chunk-sized frame buffers
"""
