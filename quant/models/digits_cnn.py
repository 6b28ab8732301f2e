"""A small CNN trained on scikit-learn's digits (1797 real 8x8 handwritten digits, 10 classes).

It has the patterns the fusion and quantization passes care about: Conv2d -> BatchNorm2d -> ReLU, a residual
``add``, a ``cat`` of two branches, max-pooling, flatten and Linear -> BatchNorm1d -> ReLU.

Shapes: input ``(B, 1, 8, 8)`` (pixel values scaled to [0, 1]), output logits ``(B, 10)``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DigitsCNN", "load_digits_tensors", "train_digits_cnn", "accuracy"]


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU stem, a residual block, a two-branch ``cat``, and an MLP head with BatchNorm1d."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.branch_a = nn.Conv2d(width, width, 1)
        self.branch_b = nn.Conv2d(width, width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 64)
        self.bn3 = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(x))
        x = torch.relu(x + y)
        x = torch.cat([self.branch_a(x), self.branch_b(x)], dim=1)
        x = self.pool(x)
        x = torch.flatten(x, 1)
        x = nn.functional.relu(self.bn3(self.fc1(x)))
        return self.fc2(x)


def load_digits_tensors(test_fraction: float = 0.25, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits as ``(x_train, y_train, x_test, y_test)``; x is ``(N, 1, 8, 8)`` in [0, 1].

    Raises:
        ImportError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("DigitsCNN's data set needs scikit-learn (pip install scikit-learn)") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def train_digits_cnn(epochs: int = 8, batch_size: int = 64, lr: float = 3e-3, seed: int = 0) -> DigitsCNN:
    """Train :class:`DigitsCNN` with Adam for a few epochs (a few seconds on one core); returns it in eval mode."""
    torch.manual_seed(seed)
    x, y, _, _ = load_digits_tensors(seed=seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy in [0, 1]."""
    return float((model(x).argmax(dim=1) == y).float().mean())
