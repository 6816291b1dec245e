"""Worker -> GPU assignment (server/workers/devices.py), without a GPU: the table for 1-8 visible GPUs,
`deviceIds` subsets, tensor-parallel groups of 2 and 4 (consecutive devices), and the
`CUDA_VISIBLE_DEVICES` a worker gets."""

from __future__ import annotations

import pytest

from pagedserve.server.workers.devices import DeviceAssignmentError, assign_devices, cuda_visible_devices


def table(visible: int, workers: int, device_ids=None, group: int = 1) -> list[tuple[int, ...]]:
    return [assign_devices(i, visible, device_ids, group) for i in range(workers)]


@pytest.mark.parametrize("visible", range(1, 9))
def test_single_device_workers_go_round_robin_over_all_visible_gpus(visible):
    assert table(visible, 2 * visible + 1) == [(i % visible,) for i in range(2 * visible + 1)]


@pytest.mark.parametrize(
    "visible, device_ids, expected",
    [
        (8, [3], [(3,), (3,), (3,)]),
        (8, [1, 5], [(1,), (5,), (1,)]),
        (4, [2, 0, 3], [(2,), (0,), (3,)]),  # in the order listed
        (8, [7, 6, 5, 4], [(7,), (6,), (5,)]),
        (2, [1], [(1,), (1,), (1,)]),
    ],
)
def test_device_ids_restrict_and_order_the_pool(visible, device_ids, expected):
    assert table(visible, 3, device_ids) == expected


@pytest.mark.parametrize(
    "visible, group, expected",
    [
        (2, 2, [(0, 1), (0, 1), (0, 1)]),
        (4, 2, [(0, 1), (2, 3), (0, 1)]),
        (5, 2, [(0, 1), (2, 3), (0, 1)]),  # the odd GPU is left out, not split across groups
        (8, 2, [(0, 1), (2, 3), (4, 5)]),
        (4, 4, [(0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)]),
        (8, 4, [(0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3)]),
        (7, 4, [(0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)]),
    ],
)
def test_tensor_parallel_groups_are_consecutive(visible, group, expected):
    assert table(visible, 3, None, group) == expected


@pytest.mark.parametrize(
    "device_ids, group, expected",
    [
        ([4, 5, 6, 7], 2, [(4, 5), (6, 7), (4, 5)]),
        ([6, 7, 0, 1], 4, [(6, 7, 0, 1)] * 3),
        ([1, 2, 3], 2, [(1, 2), (1, 2), (1, 2)]),
    ],
)
def test_tensor_parallel_groups_within_device_ids(device_ids, group, expected):
    assert table(8, 3, device_ids, group) == expected


@pytest.mark.parametrize(
    "visible, device_ids, group, words",
    [
        (0, None, 1, "no GPU is visible"),
        (2, None, 4, "parallelLevel 4 needs 4 GPUs"),
        (8, [0, 1, 2], 4, "only 3 are listed in deviceIds"),
        (4, [4], 1, "deviceIds [4] are not visible"),
        (4, [1, 1], 1, "lists a GPU twice"),
        (4, [], 1, "deviceIds is empty"),
    ],
)
def test_impossible_assignments_say_why(visible, device_ids, group, words):
    with pytest.raises(DeviceAssignmentError, match=words.replace("[", r"\[").replace("]", r"\]")):
        assign_devices(0, visible, device_ids, group)


def test_cuda_visible_devices_translates_through_the_servers_own_list():
    assert cuda_visible_devices((2, 3), {}) == "2,3"
    assert cuda_visible_devices((0, 2), {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == "4,6"
    assert cuda_visible_devices((1,), {"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}) == "GPU-bbb"


def test_device_ids_is_a_model_config_key_and_is_checked():
    import yaml

    from pagedserve.engine.model.model_config import ModelConfig, ModelConfigError

    config = ModelConfig.from_dict(yaml.safe_load("deviceType: gpu\ndeviceIds: [1, 3]\n"))
    assert config.device_ids == [1, 3]
    with pytest.raises(ModelConfigError, match="deviceIds"):
        ModelConfig.from_dict({"deviceIds": [-1]})


def test_a_gpu_model_on_a_machine_without_one_fails_to_start_saying_why(
    inprocess_factory, tiny_model, tiny_store, tmp_path_factory
):
    """The assignment runs where each worker is made (pagedserve.server.app.serve): on this CPU-only machine
    it refuses with its own words rather than a CUDA error from inside the worker."""
    from pagedserve.engine.model.archive import write_archive

    config = tmp_path_factory.mktemp("gpu-config") / "model-config.yaml"
    config.write_text(
        "deviceType: gpu\ndeviceIds: [0]\nstartupTimeout: 30\nhandler:\n  max_model_len: 256\n  kv_cache_memory: 8MiB\n"
    )
    write_archive(tiny_model, tiny_store / "gpu", model_name="tinygpu", version="1.0", config_file=config, force=True)
    server = inprocess_factory(enable_model_api=True)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the assignment is shown by describe instead")
    r = server.post("management", "/models?url=gpu/tinygpu.mar&synchronous=true")
    assert r.status == 500 and "no GPU is visible" in r.json()["message"], r.text
