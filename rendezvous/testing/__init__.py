"""What tests and the bench use in place of real hardware: the fake GPU
(:mod:`rendezvous.testing.fakegpu`), a whole ``DeviceBackend`` in host memory.
Nothing in the product imports this package; a server uses it only when it
is handed one (``Server(..., devices=Devices([FakeBackend()]))``)."""
