"""`resolve_device`: a device torch cannot provide is refused with what was asked, what this torch
has and the fix (issue 18); devices that exist pass through."""

from __future__ import annotations

import pytest
import torch

from oxygen_ros.model.device import DeviceUnavailable, resolve_device
from oxygen_ros.policy_io.policy import load_policy


def test_cpu_passes():
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_the_torch_and_the_fix(name):
    with pytest.raises(DeviceUnavailable) as caught:
        resolve_device(name)
    message = str(caught.value)
    assert message.startswith(f"device '{name}' was asked for, but torch {torch.__version__}")
    assert "torch.cuda.is_available() is False" in message
    assert "device:=cpu" in message and "CUDA build of torch" in message


def test_a_cuda_build_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(DeviceUnavailable, match="is for CUDA 12.8 but sees no usable GPU.*visible"):
        resolve_device("cuda")


def test_a_cuda_index_beyond_the_devices_seen(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(DeviceUnavailable, match=r"sees 1 CUDA device\(s\) \(cuda:0 to cuda:0\)"):
        resolve_device("cuda:3")


def test_not_a_device_name():
    with pytest.raises(DeviceUnavailable, match="'gpu0' is not a torch device"):
        resolve_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_load_policy_checks_the_device_before_loading(tiny_checkpoint):
    with pytest.raises(DeviceUnavailable, match="cannot use CUDA"):
        load_policy(tiny_checkpoint, device="cuda")
