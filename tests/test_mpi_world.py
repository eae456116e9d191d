"""Units of rendezvous.mpi.world with a scripted MPI (no MPI is initialized
here: the multi-rank behaviour is tested under mpiexec in test_mpi.py)."""

from __future__ import annotations

import pytest

from rendezvous.errors import FailedPrecondition, InvalidArgument
from rendezvous.keys import TaskName
from rendezvous.mpi.world import MpiWorld, RankAddress

pytestmark = pytest.mark.timeout(30)


class ScriptedComm:
    """COMM_WORLD of a scripted job: what every rank contributes is given."""

    def __init__(self, rank: int, contributions: list, world_id: int = 0x1234, nodes: list | None = None) -> None:
        self.rank = rank
        self.contributions = contributions
        self.world_id = world_id
        self.dups = 0
        self.nodes = nodes if nodes is not None else [0] * len(contributions)  # each rank's node
        self.freed: list = []
        #: seconds after the single-copy probe's send its message lands (scripted)
        self.lands_after = 0.0

    def Split_type(self, kind):
        assert kind == ScriptedMPI.COMM_TYPE_SHARED
        return _Ranks([r for r, node in enumerate(self.nodes) if node == self.nodes[self.rank]], self.freed,
                      me=self.rank, lands_after=self.lands_after)

    def Get_group(self):
        return _Ranks(list(range(len(self.contributions))), self.freed)

    def Dup(self) -> "ScriptedComm":
        self.dups += 1
        return self

    def bcast(self, value, root: int = 0):
        assert root == 0
        return value if self.rank == 0 else self.world_id

    def allgather(self, mine):
        out = list(self.contributions)
        out[self.rank] = mine
        return out

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.contributions)


class _Ranks:
    """A scripted node-local communicator, or a group: the world ranks it holds.
    As a communicator it plays this node's part of the single-copy probe: the
    probe's message lands ``lands_after`` seconds after it was sent."""

    def __init__(self, ranks: list, freed: list, me: int | None = None, lands_after: float = 0.0) -> None:
        self.ranks = ranks
        self.freed = freed
        self.me = me
        self.lands_after = lands_after
        self.probed: list = []

    def Get_rank(self) -> int:
        return self.ranks.index(self.me)

    def Barrier(self) -> None:
        pass

    def Isend(self, buf, dest: int, tag: int):
        self.probed.append(("Isend", len(buf[0]), dest))

        class Done:
            def Wait(self) -> None:
                pass
        return Done()

    def send(self, obj, dest: int, tag: int) -> None:
        self.probed.append(("send", dest))

    def Recv(self, buf, source: int, tag: int) -> None:
        self.probed.append(("Recv", len(buf[0]), source))

    def recv(self, source: int, tag: int) -> float:
        import time

        return time.monotonic() - self.lands_after  # when "the sender posted it"

    def bcast(self, value, root: int = 0):
        return value if self.Get_rank() == root else True

    def Get_group(self) -> "_Ranks":
        return _Ranks(self.ranks, self.freed)

    def Get_size(self) -> int:
        return len(self.ranks)

    def Translate_ranks(self, ranks: list, other: "_Ranks") -> list:
        return [other.ranks.index(self.ranks[r]) for r in ranks]

    def Free(self) -> None:
        self.freed.append(self)


class ScriptedMPI:
    THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = range(4)
    COMM_TYPE_SHARED = 7
    BYTE = "byte"

    def __init__(self, comm: ScriptedComm, level: int = 3) -> None:
        self.COMM_WORLD = comm
        self._level = level

    def Query_thread(self) -> int:
        return self._level

    def Get_library_version(self) -> str:
        return "MPICH Version:  5.0.2\nMPICH Release date: ...\n"


def _world(rank: int, contributions: list) -> MpiWorld:
    comm = ScriptedComm(rank, contributions)
    return MpiWorld(ScriptedMPI(comm), None, rank, len(contributions), "MULTIPLE", 0, "test")


def test_exchange_maps_every_task_to_its_rank_address_and_incarnation_and_agrees_on_a_world_id():
    others = [("worker", 0, 0, "10.0.0.1:5000", 11), ("worker", 0, 1, "10.0.0.2:5000", 12),
              ("ps", 0, 0, "10.0.0.3:1", 0)]
    table = _world(1, others).exchange(TaskName("worker", 0, 1), "10.0.0.2:5000", 12)
    assert table == {TaskName("worker", 0, 0): RankAddress(0, "10.0.0.1:5000", 11),
                     TaskName("worker", 0, 1): RankAddress(1, "10.0.0.2:5000", 12),
                     TaskName("ps", 0, 0): RankAddress(2, "10.0.0.3:1", 0)}
    root = _world(0, others)
    root.exchange(TaskName("worker", 0, 0), "10.0.0.1:5000")
    assert root.world_id % 2 == 1 and root.comm is not None  # rank 0 draws it (odd: never 0)
    follower = _world(2, others)
    follower.exchange(TaskName("ps", 0, 0), "10.0.0.3:1")
    assert follower.world_id == 0x1234  # what rank 0 broadcast


def test_exchange_names_the_ranks_on_other_nodes_and_frees_what_it_asked_with():
    """Ranks 0 and 2 share a node, rank 1 and 3 are elsewhere: rank 2 reaches 1
    and 3 over the network (what its loop polls with gRPC requests); the
    node's communicator and both groups are freed."""
    tasks = [("worker", 0, i, f"10.0.0.{i}:1", 0) for i in range(4)]
    comm = ScriptedComm(2, tasks, nodes=["a", "b", "a", "c"])
    world = MpiWorld(ScriptedMPI(comm), None, 2, 4, "MULTIPLE", 0, "test")
    world.exchange(TaskName("worker", 0, 2), "10.0.0.2:1")
    assert world.remote_ranks == frozenset({1, 3})
    assert len(comm.freed) == 3
    alone = _world(0, tasks[:2])
    alone.exchange(TaskName("worker", 0, 0), "10.0.0.0:1")
    assert alone.remote_ranks == frozenset()


@pytest.mark.parametrize("lands_after, expected", [(0.001, True), (0.05, False)])
def test_the_node_finds_whether_a_single_copy_moves_large_messages(lands_after, expected):
    """The node's first two ranks time one large message whose sender stays out
    of MPI for a while: landed long before that pause ends, a single copy moved
    it (the engine then never spins for this node's transfers); after it, the
    message moved only as the sender polled. Rank 0 judges, every rank gets it."""
    tasks = [("worker", 0, i, f"10.0.0.{i}:1", 0) for i in range(3)]
    comm = ScriptedComm(0, tasks, nodes=["a", "a", "b"])
    comm.lands_after = lands_after
    world = MpiWorld(ScriptedMPI(comm), None, 0, 3, "MULTIPLE", 0, "test")
    world.exchange(TaskName("worker", 0, 0), "10.0.0.0:1")
    assert world.single_copy is expected and world.remote_ranks == frozenset({2})
    sender = ScriptedComm(1, tasks, nodes=["a", "a", "b"])
    follower = MpiWorld(ScriptedMPI(sender), None, 1, 3, "MULTIPLE", 0, "test")
    follower.exchange(TaskName("worker", 0, 1), "10.0.0.1:1")
    assert follower.single_copy is True  # what the node's rank 0 broadcast (scripted)
    alone = ScriptedComm(2, tasks, nodes=["a", "a", "b"])
    lone = MpiWorld(ScriptedMPI(alone), None, 2, 3, "MULTIPLE", 0, "test")
    lone.exchange(TaskName("worker", 0, 2), "10.0.0.2:1")
    assert lone.single_copy is None  # nobody shares its node: no probe


def test_two_ranks_claiming_one_task_is_an_error_naming_both():
    same = [("worker", 0, 0, "a:1", 0), ("worker", 0, 0, "b:1", 0)]
    with pytest.raises(InvalidArgument, match="claimed by MPI ranks 0 and 1"):
        _world(0, same).exchange(TaskName("worker", 0, 0), "a:1")


def test_join_refuses_a_thread_level_below_serialized(monkeypatch):
    from rendezvous.mpi import world as world_mod

    comm = ScriptedComm(0, [None])
    monkeypatch.setattr(world_mod, "import_mpi", lambda: ScriptedMPI(comm, level=1))
    with pytest.raises(FailedPrecondition, match="FUNNELED"):
        MpiWorld.join()
    monkeypatch.setattr(world_mod, "import_mpi", lambda: ScriptedMPI(comm, level=2))
    joined = MpiWorld.join()
    assert joined.thread_level == "SERIALIZED" and joined.library == "MPICH Version: 5.0.2"
    assert (joined.rank, joined.size) == (0, 1)


def test_probe_cuda_aware_without_an_mpi_library_says_so(monkeypatch):
    from rendezvous.mpi import world as world_mod

    monkeypatch.setattr(world_mod, "_loaded_mpi_libraries", lambda: [])
    aware, how = _world(0, [None]).probe_cuda_aware()
    assert aware is False and "no CUDA query" in how
