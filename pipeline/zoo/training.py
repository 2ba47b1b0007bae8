"""What every zoo recipe shares: the recipe record, weight initialisation, optimizers and the
classifier training loop."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class ModelRecipe:
    spec: dict
    train: Callable[[nn.Module, int], dict[str, Any]]   # (model, init seed): trains in place, returns metrics
    metadata: dict[str, Any] = field(default_factory=dict)


def init_weights(model: nn.Module, scheme: str, gen: torch.Generator) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                if scheme == "kaiming":
                    nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=gen)
                elif scheme == "xavier":
                    nn.init.xavier_normal_(m.weight, generator=gen)
                else:
                    m.weight.normal_(0.0, 0.05, generator=gen)
                if m.bias is not None:
                    m.bias.zero_()


def make_optimizer(name: str, params, lr: float, wd: float):
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=lr, weight_decay=wd)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)


def fit_classifier(model, xtr, ytr, xte, yte, *, optimizer, lr, wd, epochs, batch, gen) -> dict[str, Any]:
    opt = make_optimizer(optimizer, model.parameters(), lr, wd)
    xtr_t, ytr_t = torch.from_numpy(xtr), torch.from_numpy(ytr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(xtr_t), generator=gen)
        for i in range(0, len(order), batch):
            idx = order[i:i + batch]
            opt.zero_grad()
            loss = loss_fn(model(xtr_t[idx]), ytr_t[idx])
            if not torch.isfinite(loss):
                break
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        for p in model.parameters():             # a diverged model still yields a finite graph
            torch.nan_to_num_(p.data, nan=0.0, posinf=1e3, neginf=-1e3)
        test_logits = model(torch.from_numpy(xte))
        train_logits = model(xtr_t)
        test_loss = float(loss_fn(test_logits, torch.from_numpy(yte)))
    return {"test_accuracy": float((test_logits.argmax(1).numpy() == yte).mean()),
            "train_accuracy": float((train_logits.argmax(1).numpy() == ytr).mean()),
            "test_loss": test_loss if math.isfinite(test_loss) else None}
