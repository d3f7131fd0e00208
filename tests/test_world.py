"""data_parallel_world in one process: what a strategy's distributed_sampler_kwargs and device mesh give, and the
strategies it refuses, with stand-ins for Trainers, strategies and meshes."""

from types import SimpleNamespace

import pytest
import torch

from lit_balance.world import DataParallelWorld, data_parallel_world


class FakeMesh:
    """A device mesh as data_parallel_world reads it: named dimensions, a size, a local rank, a process group."""

    def __init__(self, sizes, ranks, names=("data_parallel", "tensor_parallel")):
        self.sizes, self.ranks, self.mesh_dim_names = dict(zip(names, sizes)), dict(zip(names, ranks)), names
        self.ndim = len(names)

    def __getitem__(self, name):
        return FakeMesh([self.sizes[name]], [self.ranks[name]], (name,))

    def size(self):
        return self.sizes[self.mesh_dim_names[0]]

    def get_local_rank(self):
        return self.ranks[self.mesh_dim_names[0]]

    def get_group(self):
        return f"group of {self.mesh_dim_names[0]}"


def trainer(world_size, global_rank, **strategy):
    return SimpleNamespace(world_size=world_size, global_rank=global_rank, strategy=SimpleNamespace(**strategy))


def test_ddp_every_process_is_a_data_parallel_rank():
    world = data_parallel_world(trainer(4, 3, distributed_sampler_kwargs={"num_replicas": 4, "rank": 3}))
    assert (world.rank, world.num_replicas, world.process_group) == (3, 4, None)


def test_one_process_needs_nothing_from_the_strategy():
    assert data_parallel_world(SimpleNamespace(world_size=1, global_rank=0, strategy=object())) == \
        DataParallelWorld(rank=0, num_replicas=1)


@pytest.mark.parametrize(("dp", "tp", "global_rank"), [(1, 2, 1), (2, 2, 3), (2, 2, 2), (3, 2, 4), (2, 1, 1)])
def test_model_parallel_takes_the_mesh_data_parallel_dimension_and_its_group(dp, tp, global_rank):
    mesh = FakeMesh((dp, tp), (global_rank // tp, global_rank % tp))
    world = data_parallel_world(trainer(dp * tp, global_rank, device_mesh=mesh, distributed_sampler_kwargs={
        "num_replicas": dp, "rank": global_rank // tp}))
    assert (world.rank, world.num_replicas) == (global_rank // tp, dp)
    if dp > 1 and tp > 1:
        assert world.process_group == "group of data_parallel"  # collectives over the replicas, not every process
    else:
        assert world.process_group is None  # one replica (no collective) or every process one (the default group)


def test_collectives_of_one_data_parallel_rank_never_communicate():
    world = data_parallel_world(trainer(2, 1, device_mesh=FakeMesh((1, 2), (0, 1)),
                                        distributed_sampler_kwargs={"num_replicas": 1, "rank": 0}))
    t = torch.tensor([1.0, 2.0])
    assert world.all_gather(t).tolist() == [[1.0, 2.0]]
    assert world.all_reduce_sum(t).tolist() == [1.0, 2.0] and world.broadcast(t).tolist() == [1.0, 2.0]


@pytest.mark.parametrize(("strategy", "match"), [
    ({}, r"the SimpleNamespace strategy runs 2 processes but does not say which data-parallel rank .* None"),
    ({"distributed_sampler_kwargs": None}, r"does not say which data-parallel rank this process is"),
    ({"distributed_sampler_kwargs": {"num_replicas": 2}}, r"not a dict with num_replicas and rank"),
    ({"distributed_sampler_kwargs": {"num_replicas": 3, "rank": 0}}, r"expected num_replicas dividing 2"),
    ({"distributed_sampler_kwargs": {"num_replicas": 2, "rank": 2}}, r"0 <= rank < num_replicas"),
    ({"distributed_sampler_kwargs": {"num_replicas": 2.0, "rank": 1}}, r"do not describe a data-parallel world"),
    ({"distributed_sampler_kwargs": {"num_replicas": 2, "rank": 0}}, r"rank 0 differs from this process's global "
                                                                      r"rank 1"),
    ({"distributed_sampler_kwargs": {"num_replicas": 1, "rank": 0}}, r"1 data-parallel ranks for 2 processes, but "
                                                                      r"the strategy has no device_mesh"),
    ({"distributed_sampler_kwargs": {"num_replicas": 1, "rank": 0}, "device_mesh": FakeMesh((2,), (0,), ("tp",))},
     r"no device_mesh with a 'data_parallel' dimension \(found \['tp'\]\)"),
    ({"distributed_sampler_kwargs": {"num_replicas": 1, "rank": 0}, "device_mesh": FakeMesh((2, 1), (1, 0))},
     r"disagree with its device mesh's 'data_parallel' dimension \(num_replicas=2, rank=1\)"),
])
def test_a_strategy_whose_data_parallel_world_is_unknown_is_refused(strategy, match):
    with pytest.raises(RuntimeError, match=match) as error:
        data_parallel_world(trainer(2, 1, **strategy))
    assert "distributed_sampler_kwargs property" in str(error.value)  # what to do
    assert "docs/strategies.md" in str(error.value)


def test_a_strategy_whose_mesh_is_not_set_up_yet_is_refused():
    class Strategy:
        distributed_sampler_kwargs = {"num_replicas": 1, "rank": 0}

        @property
        def device_mesh(self):
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")

    with pytest.raises(RuntimeError, match="the Strategy strategy's .* no device_mesh"):
        data_parallel_world(SimpleNamespace(world_size=2, global_rank=0, strategy=Strategy()))


def test_a_mesh_gives_the_world_without_lightning():
    world = data_parallel_world(mesh=FakeMesh((2, 2), (1, 0), ("dp", "tp")))
    assert (world.rank, world.num_replicas, world.process_group) == (1, 2, "group of dp")
    one_d = data_parallel_world(mesh=FakeMesh((4,), (3,), ("replicas",)))
    assert (one_d.rank, one_d.num_replicas) == (3, 4)


def test_bad_mesh_and_sources_are_refused():
    with pytest.raises(ValueError, match=r"dimensions named \['cp', 'tp'\], none of them a data-parallel one"):
        data_parallel_world(mesh=FakeMesh((2, 2), (0, 0), ("cp", "tp")))
    with pytest.raises(TypeError, match="mesh must be a torch.distributed.device_mesh.DeviceMesh, got int"):
        data_parallel_world(mesh=3)
    with pytest.raises(ValueError, match="at most one of trainer, mesh and process_group, got trainer and mesh"):
        data_parallel_world(trainer(1, 0), mesh=FakeMesh((1,), (0,), ("dp",)))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        data_parallel_world(process_group=object())


@pytest.mark.parametrize("method", ["reduce", "all_reduce"])  # a Lightning strategy's, a Fabric strategy's
def test_all_reduce_sum_leaves_the_callers_tensor_alone(method):
    def in_place_sum(tensor, reduce_op):  # as Lightning's and Fabric's DDP reduce: torch.distributed.all_reduce
        assert reduce_op == "sum"
        return tensor.mul_(2)

    strategy = {method: in_place_sum, "distributed_sampler_kwargs": {"num_replicas": 2, "rank": 0}}
    world = data_parallel_world(trainer(2, 0, **strategy))
    local = torch.tensor([1.0, 3.0])
    assert world.all_reduce_sum(local).tolist() == [2.0, 6.0]
    assert local.tolist() == [1.0, 3.0]


def test_a_strategy_asked_before_its_processes_exist_is_told_when_to_ask():
    class ModelParallelStrategy:  # Lightning's raises from distributed_sampler_kwargs before setup_environment()
        @property
        def distributed_sampler_kwargs(self):
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")

    with pytest.raises(RuntimeError, match=r"the ModelParallelStrategy strategy cannot say its data-parallel world yet "
                                           r"\(Accessing the device mesh .*\); ask for it once the Trainer has set up"):
        data_parallel_world(SimpleNamespace(world_size=2, global_rank=0, strategy=ModelParallelStrategy()))
