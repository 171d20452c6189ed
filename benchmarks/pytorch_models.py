"""The benchmark models in Python PyTorch, the same architectures as the C++ side."""
import torch
import torch.nn as nn


class FashionNet(nn.Module):
    """examples/fashion_net.hpp's CNN: two conv blocks and two linear layers (~420k parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(self.dropout(torch.relu(self.fc1(x.flatten(1)))))


def wide_mlp(width=1024, layers=2):
    """bench_common.hpp's WideMlp: 784 -> width (x layers, ReLU) -> 10."""
    modules, inputs = [], 784
    for _ in range(layers):
        modules += [nn.Linear(inputs, width), nn.ReLU()]
        inputs = width
    return nn.Sequential(*modules, nn.Linear(inputs, 10))


# Multiply-adds of one forward pass per sample, as bench_common.hpp counts them.
FASHION_NET_FORWARD_MACS = 28 * 28 * 32 * 9 + 14 * 14 * 64 * 32 * 9 + 64 * 7 * 7 * 128 + 128 * 10
