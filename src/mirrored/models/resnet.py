"""ResNets: ResNet-18/34/50 for ImageNet-sized inputs and the small CIFAR-style ResNet for 32x32.

`resnet18`, `resnet34` and `resnet50` build the networks of He et al. 2015 with the module names
and tensor shapes of torchvision's `resnet18/34/50` (v1.5: a Bottleneck strides in its 3x3 conv),
so a torchvision state_dict loads with `load_state_dict` unchanged. `resnet_cifar(depth=6n+2)` is
the 3-stage network of the paper's CIFAR-10 section (ResNet-20/32/44/56/110). Every model returns
logits and takes the image layout its `data_format` declares, Keras's names and default:
"channels_last" (default) takes NHWC batches, as mr.datasets yields images, and reads them as NCHW
views in channels_last memory (no copy); "channels_first" takes NCHW batches, as torchvision's
models do. A batch of the other layout is refused, never guessed from its shape. Uses torch only.
"""
from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_Net = TypeVar("_Net", bound=nn.Module)

__all__ = ["DATA_FORMATS", "BasicBlock", "Bottleneck", "CifarResNet", "ResNet", "resnet18", "resnet34", "resnet50",
           "resnet_cifar"]

DATA_FORMATS = ("channels_last", "channels_first")  # Keras's data_format values: NHWC and NCHW batches


def _check_data_format(data_format: str) -> str:
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format={data_format!r}: use \"channels_last\" (NHWC batches, as mr.datasets yields "
                         "images; the default, as in Keras) or \"channels_first\" (NCHW batches, as torchvision's).")
    return data_format


def _as_nchw(x: Tensor, data_format: str, channels: int, model: nn.Module) -> Tensor:
    """The batch as NCHW, from the layout `data_format` declares (an NHWC batch becomes an NCHW view in
    channels_last memory); a batch of another layout is refused with the fix."""
    axis = -1 if data_format == "channels_last" else 1
    if x.dim() != 4 or x.shape[axis] != channels:
        layout = "NHWC (N, H, W, C)" if data_format == "channels_last" else "NCHW (N, C, H, W)"
        other = "channels_first" if data_format == "channels_last" else "channels_last"
        raise ValueError(f"{type(model).__name__}(data_format={data_format!r}) takes {layout} batches with C = "
                         f"{channels}; got shape {tuple(x.shape)}. For the other layout build it with "
                         f"data_format={other!r}, or change the pipeline (image.permute(2, 0, 1) makes CHW).")
    return x.permute(0, 3, 1, 2) if data_format == "channels_last" else x


def _conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False)


def _projection(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    """The 1x1-conv + BN shortcut; as a Sequential so its keys are downsample.0 / downsample.1."""
    return nn.Sequential(_conv1x1(in_channels, out_channels, stride), nn.BatchNorm2d(out_channels))


class BasicBlock(nn.Module):
    """Two 3x3 convs plus a shortcut (ResNet-18/34 and the CIFAR ResNets)."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(in_channels, channels, stride)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(channels, channels)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = downsample
        self.stride = stride

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm before the residual sum (bn2), whose weight zero_init_residual zeroes so the
        block starts as the identity."""
        return self.bn2

    def forward(self, x: Tensor) -> Tensor:
        """relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), on an NCHW tensor."""
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + shortcut)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as torchvision v1.5), 1x1 expand by 4, plus a shortcut (ResNet-50)."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(in_channels, channels)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = _conv3x3(channels, channels, stride)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = _conv1x1(channels, channels * self.expansion)
        self.bn3 = nn.BatchNorm2d(channels * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm before the residual sum (bn3), whose weight zero_init_residual zeroes so the
        block starts as the identity."""
        return self.bn3

    def forward(self, x: Tensor) -> Tensor:
        """The 1x1, 3x3, 1x1 convs (each with BN, ReLU after the first two) plus shortcut(x), then ReLU,
        on an NCHW tensor."""
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + shortcut)


class _PadShortcut(nn.Module):
    """The CIFAR paper's parameter-free shortcut ("option A"): subsample by `stride`, zero-pad channels."""

    def __init__(self, extra_channels: int, stride: int):
        super().__init__()
        self.extra_channels = extra_channels
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        # F.pad's pairs run from the last dim backwards: (W, W, H, H, C, C).
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))

    def extra_repr(self) -> str:
        return f"extra_channels={self.extra_channels}, stride={self.stride}"


def _init_weights(model: nn.Module, zero_init_residual: bool) -> None:
    """He (fan_out) init for convs, BN to identity; zero_init_residual starts each block as identity
    (Goyal et al. 2017), which helps large-batch training. Linear layers keep torch's default."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    if zero_init_residual:
        for m in model.modules():
            if isinstance(m, (BasicBlock, Bottleneck)):
                nn.init.zeros_(m.last_bn().weight)


class ResNet(nn.Module):
    """The ImageNet ResNet: 7x7/2 stem, 3x3/2 max pool, four stages, global average pool, fc."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        blocks_per_stage: tuple[int, int, int, int],
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        in_channels: int = 3,
        data_format: str = "channels_last",
    ):
        super().__init__()
        _check_positive("num_classes", num_classes)
        _check_positive("in_channels", in_channels)
        self.data_format = _check_data_format(data_format)
        self._channels = 64
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, 64, blocks_per_stage[0], stride=1)
        self.layer2 = self._stage(block, 128, blocks_per_stage[1], stride=2)
        self.layer3 = self._stage(block, 256, blocks_per_stage[2], stride=2)
        self.layer4 = self._stage(block, 512, blocks_per_stage[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        _init_weights(self, zero_init_residual)

    def _stage(self, block: type[BasicBlock] | type[Bottleneck], channels: int, blocks: int,
               stride: int) -> nn.Sequential:
        out_channels = channels * block.expansion
        downsample = None
        if stride != 1 or self._channels != out_channels:
            downsample = _projection(self._channels, out_channels, stride)
        layers = [block(self._channels, channels, stride, downsample)]
        self._channels = out_channels
        layers += [block(out_channels, channels) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (N, num_classes) for a batch in the layout `data_format` declares (NHWC by
        default); a batch of the other layout is a ValueError naming the fix."""
        x = _as_nchw(x, self.data_format, self.conv1.in_channels, self)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class CifarResNet(nn.Module):
    """He et al. 2015, section 4.2: 3x3 stem, three stages of n BasicBlocks at width, 2*width and
    4*width channels (feature maps 32, 16, 8 for 32x32 inputs), global average pool, fc."""

    def __init__(self, depth: int = 20, num_classes: int = 10, width: int = 16, in_channels: int = 3,
                 data_format: str = "channels_last"):
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ValueError(
                f"resnet_cifar(depth={depth!r}): depth must be 6n+2 for a whole number n >= 1 (8, 14, 20, 32, "
                "44, 56, 110, ...): each of the 3 stages holds n blocks of 2 convs, plus the stem and the fc."
            )
        _check_positive("num_classes", num_classes)
        _check_positive("width", width)
        _check_positive("in_channels", in_channels)
        blocks = (depth - 2) // 6
        self.depth = depth
        self.data_format = _check_data_format(data_format)
        self.conv1 = _conv3x3(in_channels, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._stage(width, width, blocks, stride=1)
        self.layer2 = self._stage(width, 2 * width, blocks, stride=2)
        self.layer3 = self._stage(2 * width, 4 * width, blocks, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(4 * width, num_classes)
        _init_weights(self, zero_init_residual=False)

    @staticmethod
    def _stage(in_channels: int, channels: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or in_channels != channels:
            downsample = _PadShortcut(channels - in_channels, stride)
        layers = [BasicBlock(in_channels, channels, stride, downsample)]
        layers += [BasicBlock(channels, channels) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape (N, num_classes) for a batch in the layout `data_format` declares (NHWC by
        default); a batch of the other layout is a ValueError naming the fix."""
        x = _as_nchw(x, self.data_format, self.conv1.in_channels, self)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive int.")


def _recorded(net: _Net, name: str, **kwargs: object) -> _Net:
    """Notes how `net` was built, so Model.save() can store it and Model.load() rebuild it with
    models.get(name, **kwargs) without unpickling anything."""
    net._mirrored_config = {"name": name, "kwargs": kwargs}
    return net


def resnet18(num_classes: int = 1000, zero_init_residual: bool = False, in_channels: int = 3,
             data_format: str = "channels_last") -> ResNet:
    """ResNet-18 (11.7M parameters at 1000 classes); state_dict-compatible with torchvision's."""
    net = ResNet(BasicBlock, (2, 2, 2, 2), num_classes, zero_init_residual, in_channels, data_format)
    return _recorded(net, "resnet18", num_classes=num_classes, zero_init_residual=zero_init_residual,
                     in_channels=in_channels, data_format=data_format)


def resnet34(num_classes: int = 1000, zero_init_residual: bool = False, in_channels: int = 3,
             data_format: str = "channels_last") -> ResNet:
    """ResNet-34 (21.8M parameters at 1000 classes); state_dict-compatible with torchvision's."""
    net = ResNet(BasicBlock, (3, 4, 6, 3), num_classes, zero_init_residual, in_channels, data_format)
    return _recorded(net, "resnet34", num_classes=num_classes, zero_init_residual=zero_init_residual,
                     in_channels=in_channels, data_format=data_format)


def resnet50(num_classes: int = 1000, zero_init_residual: bool = False, in_channels: int = 3,
             data_format: str = "channels_last") -> ResNet:
    """ResNet-50 v1.5 (25.6M parameters at 1000 classes); state_dict-compatible with torchvision's."""
    net = ResNet(Bottleneck, (3, 4, 6, 3), num_classes, zero_init_residual, in_channels, data_format)
    return _recorded(net, "resnet50", num_classes=num_classes, zero_init_residual=zero_init_residual,
                     in_channels=in_channels, data_format=data_format)


def resnet_cifar(depth: int = 20, num_classes: int = 10, width: int = 16, in_channels: int = 3,
                 data_format: str = "channels_last") -> CifarResNet:
    """The CIFAR-10 ResNet of depth 6n+2 (ResNet-20: 0.27M parameters) with the paper's
    parameter-free shortcuts (subsample + zero-pad channels) where the shape changes."""
    net = CifarResNet(depth, num_classes, width, in_channels, data_format)
    return _recorded(net, "resnet_cifar", depth=depth, num_classes=num_classes, width=width,
                     in_channels=in_channels, data_format=data_format)
