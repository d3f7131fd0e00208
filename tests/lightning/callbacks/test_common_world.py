"""gather_same_everywhere: what the callbacks decide on is global rank 0's gathered figures on every process."""

from types import SimpleNamespace

import torch

from lit_balance.lightning.callbacks._common import gather_same_everywhere


class Mesh1D:
    mesh_dim_names, ndim = ("data_parallel",), 1

    def size(self):
        return 1

    def get_local_rank(self):
        return 0

    def get_group(self):
        return None


class TensorParallelStrategy:
    """Two processes, one replica (dp=1 x tp=2); broadcast returns what global rank 0 holds."""

    distributed_sampler_kwargs = {"num_replicas": 1, "rank": 0}

    def __init__(self, rank0_value):
        self.rank0_value, self.broadcasts = rank0_value, 0

    def broadcast(self, obj, src=0):
        assert src == 0
        self.broadcasts += 1
        return self.rank0_value


class MeshOf2D(dict):
    """A (data_parallel, tensor_parallel) mesh: indexing by name gives the 1-D sub-mesh."""

    mesh_dim_names = ("data_parallel", "tensor_parallel")
    ndim = 2


def test_tensor_parallel_peers_get_global_rank_0s_figures():
    rank0 = torch.tensor([[5.0, 6.0]])
    strategy = TensorParallelStrategy(rank0)
    strategy.device_mesh = MeshOf2D(data_parallel=Mesh1D())
    trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=strategy)
    out = gather_same_everywhere(trainer, torch.tensor([1.0, 2.0]))  # this process timed other seconds
    assert out.tolist() == [[5.0, 6.0]] and strategy.broadcasts == 1


def test_ddp_needs_no_broadcast():
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1},
                               all_gather=lambda t: torch.stack([t * 0, t]), broadcast=lambda obj, src=0: 1 / 0)
    trainer = SimpleNamespace(world_size=2, global_rank=1, strategy=strategy)
    assert gather_same_everywhere(trainer, torch.tensor([1.0, 2.0])).tolist() == [[0.0, 0.0], [1.0, 2.0]]
