"""A ResNet-50-shaped Model A built from torch.nn alone (torchvision is not installed beside
torch 2.13 here): bottleneck blocks [3, 4, 6, 3], 25.6 M parameters, 4.1 GFLOP per 224x224
image, random weights from a fixed seed. Input: uint8 images, normalised inside the model so
the dataset stays cheap (a quarter of float32's bytes to collate and copy)."""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        return self.relu(self.body(x) + skip)


class ResNet(nn.Module):
    """Returns ``{"features": [B, 32 * base], "logits": [B, classes]}`` (ResNet-50: 2048, 1000)."""

    def __init__(self, classes: int = 1000, blocks: tuple[int, ...] = (3, 4, 6, 3), base: int = 64) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], base
        for stage, count in enumerate(blocks):
            width = base * 2**stage
            for b in range(count):
                layers.append(Bottleneck(cin, width, 2 if b == 0 and stage > 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():  # damp each block's residual branch: a stable random network
            if isinstance(m, Bottleneck):
                nn.init.constant_(m.body[-1].weight, 0.2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = (x.float() - self.mean) / self.std
        f = self.pool(self.layers(self.stem(x))).flatten(1)
        return {"features": f, "logits": self.fc(f)}


def resnet50(seed: int = 0) -> ResNet:
    """ResNet-50's shape with random weights from ``seed``."""
    torch.manual_seed(seed)
    return ResNet().eval()


def tiny_resnet(seed: int = 0) -> ResNet:
    """One bottleneck per stage at 1/8 of the width: the same code path in a fraction of the
    work (what the test of the GPU check runs on the CPU)."""
    torch.manual_seed(seed)
    return ResNet(classes=10, blocks=(1, 1, 1, 1), base=8).eval()
