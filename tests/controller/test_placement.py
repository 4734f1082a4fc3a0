"""choose_nodes: which Ray node each entry of a ResourcePool runs on (distinct nodes, the driver's first, only
nodes whose resources hold the processes), and the error listing the nodes when there are too few."""

import pytest

from pyrl.controller.worker_group import Node, PlacementError, choose_nodes

HEAD = Node("aa" * 28, "10.0.0.1", "head", cpus=8, gpus=0)
GPU_A = Node("bb" * 28, "10.0.0.2", "gpu-a", cpus=32, gpus=8)
GPU_B = Node("cc" * 28, "10.0.0.3", "gpu-b", cpus=32, gpus=8)


def test_distinct_nodes_the_drivers_first():
    assert choose_nodes([GPU_A, GPU_B, HEAD], [2, 2], 1, 0, first=HEAD.id) == [HEAD, GPU_A]
    assert choose_nodes([GPU_A, GPU_B, HEAD], [2, 2], 1, 0, first=GPU_B.id) == [GPU_B, GPU_A]


def test_nodes_without_the_resources_are_passed_over():
    assert choose_nodes([HEAD, GPU_A, GPU_B], [8, 8], 1, 1, first=HEAD.id) == [GPU_A, GPU_B]  # the head has no GPU
    assert choose_nodes([HEAD, GPU_A], [1], 16, 0, first=HEAD.id) == [GPU_A]  # 16 CPUs: not the head's 8


def test_too_few_nodes_name_every_node():
    with pytest.raises(PlacementError, match=r"2 distinct node\(s\) wanted, one per entry of \[8 x \{CPU: 1, GPU: 1\}, "
                                             r"8 x \{CPU: 1, GPU: 1\}\], but only 1 .*Nodes: aaaaaaaa \(10\.0\.0\.1, "
                                             r"head\): CPU 8, GPU 0; bbbbbbbb \(10\.0\.0\.2, gpu-a\): CPU 32, GPU 8"):
        choose_nodes([HEAD, GPU_A], [8, 8], 1, 1, first=HEAD.id)
