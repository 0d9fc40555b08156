"""models/resnet.py: torchvision-compatible names and shapes, parameter counts, init, CIFAR ResNets.

torchvision is not available, so the expected state_dict layout is written out here from
torchvision's naming rules (an independent reference, not our own code)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import mirrored.models as models
from mirrored.models import resnet18, resnet34, resnet50, resnet_cifar


def _bn(prefix: str, c: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (c,), f"{prefix}.bias": (c,), f"{prefix}.running_mean": (c,),
            f"{prefix}.running_var": (c,), f"{prefix}.num_batches_tracked": ()}


def torchvision_layout(bottleneck: bool, blocks: tuple[int, ...], num_classes: int = 1000,
                       in_channels: int = 3) -> dict[str, tuple[int, ...]]:
    """state_dict key -> shape of torchvision.models.resnet{18,34,50}, written from its naming rules."""
    want = {"conv1.weight": (64, in_channels, 7, 7), **_bn("bn1", 64)}
    expansion = 4 if bottleneck else 1
    c_in = 64
    for stage, (width, n) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        for b in range(n):
            p = f"layer{stage}.{b}"
            convs = ([(width, c_in, 1), (width, width, 3), (width * 4, width, 1)] if bottleneck
                     else [(width, c_in, 3), (width, width, 3)])
            for i, (c_out, c, k) in enumerate(convs, start=1):
                want[f"{p}.conv{i}.weight"] = (c_out, c, k, k)
                want.update(_bn(f"{p}.bn{i}", c_out))
            if b == 0 and (stage > 1 or c_in != width * expansion):
                want[f"{p}.downsample.0.weight"] = (width * expansion, c_in, 1, 1)
                want.update(_bn(f"{p}.downsample.1", width * expansion))
            c_in = width * expansion
    want["fc.weight"] = (num_classes, 512 * expansion)
    want["fc.bias"] = (num_classes,)
    return want


def shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("build, count", [(resnet18, 11_689_512), (resnet34, 21_797_672), (resnet50, 25_557_032)])
def test_parameter_counts_match_torchvision(build, count):
    assert sum(p.numel() for p in build().parameters()) == count


@pytest.mark.parametrize("build, bottleneck, blocks", [
    (resnet18, False, (2, 2, 2, 2)), (resnet34, False, (3, 4, 6, 3)), (resnet50, True, (3, 4, 6, 3))])
def test_state_dict_layout_is_torchvisions(build, bottleneck, blocks):
    got = shapes(build(num_classes=7, in_channels=1))
    want = torchvision_layout(bottleneck, blocks, num_classes=7, in_channels=1)
    assert list(got) == list(want)  # same keys in the same (registration) order
    assert got == want


def test_selected_keys_and_shapes():
    r18, r50 = shapes(resnet18()), shapes(resnet50())
    assert r18["layer1.0.conv1.weight"] == (64, 64, 3, 3)
    assert r18["layer2.0.downsample.0.weight"] == (128, 64, 1, 1)
    assert r18["fc.weight"] == (1000, 512)
    assert "layer1.0.downsample.0.weight" not in r18
    assert r50["layer4.2.bn3.running_mean"] == (2048,)
    assert r50["layer2.0.downsample.0.weight"] == (512, 256, 1, 1)
    assert r50["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)  # 64 -> 256 needs a projection
    assert r50["layer2.0.conv2.weight"] == (128, 128, 3, 3)
    assert r50["fc.weight"] == (1000, 2048)


def test_bottleneck_strides_in_its_3x3_conv_like_torchvision_v1_5():
    net = resnet50()
    block = net.layer3[0]
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2) and block.conv3.stride == (1, 1)
    assert block.downsample[0].stride == (2, 2)
    assert resnet18().layer2[0].conv1.stride == (2, 2)


def test_state_dict_round_trip_gives_the_same_function():
    torch.manual_seed(0)
    src, dst = resnet18(num_classes=3).eval(), resnet18(num_classes=3).eval()
    x = torch.randn(2, 64, 64, 3)  # NHWC: the default data_format, channels_last
    with torch.no_grad():  # make BN statistics non-trivial so a missing buffer would show
        for m in src.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    dst.load_state_dict(src.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.equal(src(x), dst(x))


@pytest.mark.parametrize("build", [resnet18, resnet34, resnet50])
def test_output_shape_and_in_channels(build):
    net = build(num_classes=5, in_channels=1, data_format="channels_first").eval()
    with torch.no_grad():
        assert net(torch.randn(2, 1, 64, 64)).shape == (2, 5)
        assert net(torch.randn(1, 1, 33, 47)).shape == (1, 5)  # any size: adaptive average pool


def test_init_kaiming_fan_out_and_batchnorm_identity():
    torch.manual_seed(0)
    net = resnet50()
    conv = net.layer4[0].conv2  # 512 -> 512, 3x3: fan_out = 512 * 9
    want_std = math.sqrt(2.0 / (512 * 9))
    assert abs(conv.weight.std().item() / want_std - 1) < 0.02
    assert abs(conv.weight.mean().item()) < 0.05 * want_std
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert torch.equal(m.bias, torch.zeros_like(m.bias))
    assert net.layer4[0].bn3.weight.abs().sum() > 0  # not zeroed unless asked


@pytest.mark.parametrize("build, last", [(resnet18, "bn2"), (resnet50, "bn3")])
def test_zero_init_residual_zeroes_the_last_bn_gamma_of_each_block(build, last):
    net = build(zero_init_residual=True)
    blocks = [b for layer in (net.layer1, net.layer2, net.layer3, net.layer4) for b in layer]
    for block in blocks:
        assert torch.count_nonzero(getattr(block, last).weight) == 0
        assert torch.equal(block.bn1.weight, torch.ones_like(block.bn1.weight))
    for block in blocks:
        if block.downsample is not None:
            assert torch.equal(block.downsample[1].weight, torch.ones_like(block.downsample[1].weight))


@pytest.mark.parametrize("build, size", [(lambda: resnet18(num_classes=4, data_format="channels_first"), 64),
                                         (lambda: resnet_cifar(20, data_format="channels_first"), 32)])
def test_channels_last_matches_contiguous(build, size):
    torch.manual_seed(0)
    net = build().eval()
    x = torch.randn(3, 3, size, size)
    with torch.no_grad():
        want = net(x)
        net_cl = net.to(memory_format=torch.channels_last)
        got = net_cl(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_channels_last_trains():
    """Gradients in channels_last memory equal the same net's in NCHW (training-mode BatchNorm), up to
    the reassociation of channels-last kernels (measured: 2.4e-7 at most, on gradients up to 0.4)."""
    torch.manual_seed(0)
    ref = resnet_cifar(8, num_classes=3, data_format="channels_first").train()
    net = copy.deepcopy(ref).to(memory_format=torch.channels_last)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    nn.functional.cross_entropy(net(x.to(memory_format=torch.channels_last)), y).backward()
    nn.functional.cross_entropy(ref(x), y).backward()
    for (name, got), want in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5, msg=name)


def cifar_parameter_count(depth: int, width: int, num_classes: int, in_channels: int = 3) -> int:
    """Closed form: stem conv+BN, 3 stages of n blocks (two 3x3 convs + two BNs), fc; no projection."""
    n = (depth - 2) // 6
    total = in_channels * width * 9 + 2 * width
    c_in = width
    for c in (width, 2 * width, 4 * width):
        total += (c_in * c * 9 + 2 * c) + (c * c * 9 + 2 * c)  # first block of the stage
        total += (n - 1) * 2 * (c * c * 9 + 2 * c)
        c_in = c
    return total + 4 * width * num_classes + num_classes


@pytest.mark.parametrize("depth", [8, 20, 32, 56, 110])
def test_cifar_resnet_parameter_count(depth):
    net = resnet_cifar(depth)
    assert sum(p.numel() for p in net.parameters()) == cifar_parameter_count(depth, 16, 10)
    blocks = sum(len(layer) for layer in (net.layer1, net.layer2, net.layer3))
    assert blocks == (depth - 2) // 2


def test_cifar_resnet_20_is_the_papers_size():
    assert sum(p.numel() for p in resnet_cifar(20).parameters()) == 269_722  # paper: 0.27M


def test_cifar_resnet_shapes_per_stage():
    net = resnet_cifar(20, num_classes=7, width=8, in_channels=1, data_format="channels_first").eval()
    seen = {}
    for name in ("layer1", "layer2", "layer3"):
        getattr(net, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, tuple(o.shape)))
    with torch.no_grad():
        assert net(torch.randn(2, 1, 32, 32)).shape == (2, 7)
    assert seen == {"layer1": (2, 8, 32, 32), "layer2": (2, 16, 16, 16), "layer3": (2, 32, 8, 8)}
    assert not hasattr(net, "maxpool")
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)


def test_cifar_shortcut_subsamples_and_zero_pads_channels():
    net = resnet_cifar(8, width=4)
    shortcut = net.layer2[0].downsample
    x = torch.randn(2, 4, 8, 8)
    out = shortcut(x)
    assert out.shape == (2, 8, 4, 4)
    assert torch.equal(out[:, :4], x[:, :, ::2, ::2])
    assert torch.count_nonzero(out[:, 4:]) == 0
    assert list(shortcut.parameters()) == []


@pytest.mark.parametrize("depth", [0, 7, 19, 21, 2, 20.0, True, "20"])
def test_cifar_depth_must_be_6n_plus_2(depth):
    with pytest.raises(ValueError, match=r"depth must be 6n\+2"):
        resnet_cifar(depth)


@pytest.mark.parametrize("kwargs", [{"num_classes": 0}, {"width": -1}, {"in_channels": 2.5}])
def test_cifar_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))}="):
        resnet_cifar(20, **kwargs)


def test_resnet_rejects_bad_num_classes():
    with pytest.raises(ValueError, match="num_classes=0: must be a positive int"):
        resnet18(num_classes=0)


def test_registry_builds_by_name():
    net = models.get("resnet20", num_classes=3)
    assert isinstance(net, models.CifarResNet) and net.depth == 20 and net.fc.out_features == 3
    assert models.get("resnet_cifar", depth=14).depth == 14
    assert models.get("ResNet18", num_classes=2).fc.out_features == 2
    assert {"resnet18", "resnet34", "resnet50", "resnet_cifar", "resnet20", "resnet56"} <= set(models.names())


def test_registry_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown model 'resnet101'. Known models: .*resnet18.*resnet50"):
        models.get("resnet101")
    with pytest.raises(TypeError, match="fixes the depth"):
        models.get("resnet20", depth=32)


@pytest.mark.parametrize("name, kwargs", [("resnet18", {"num_classes": 3}), ("resnet20", {"num_classes": 4}),
                                          ("resnet_cifar", {"depth": 14, "width": 8})])
def test_models_record_how_to_rebuild_them(name, kwargs):
    """Model.save() stores `_mirrored_config`; Model.load() calls models.get(name, **kwargs) with it."""
    net = models.get(name, **kwargs)
    config = net._mirrored_config
    rebuilt = models.get(config["name"], **config["kwargs"])
    assert type(rebuilt) is type(net) and shapes(rebuilt) == shapes(net)
    rebuilt.load_state_dict(net.state_dict())
