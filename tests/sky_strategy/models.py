"""A small LightningModule following the pipeline convention, its data and a single-process reference."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class Net(L.LightningModule):
    """embed -> N residual blocks -> head; every block is one pipeline layer."""

    pipeline_layers = ("embed", "blocks", "head")  # the SkyStrategy convention: layers in forward order

    def __init__(self, depth: int = 6, width: int = 32, classes: int = 4, lr: float = 1e-2, sync_dist: bool = False,
                 aux: float = 0.0, l2: float = 0.0, dropout: float = 0.0, aux_in_loss_fn: bool = False):
        super().__init__()
        # extra terms of the training loss beyond loss_fn (issue 18); `aux_in_loss_fn` moves the auxiliary
        # term into loss_fn itself (the pipeline then backpropagates it per microbatch, in one pass)
        self.aux, self.l2, self.aux_in_loss_fn = aux, l2, aux_in_loss_fn
        self.embed = nn.Linear(16, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.lr = lr
        self.sync_dist = sync_dist  # data-parallel replicas: log the mean over replicas (the global batch's)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss_fn(self, output, target):
        loss = F.cross_entropy(output, target)
        return loss + self.aux * output.pow(2).mean() if self.aux_in_loss_fn else loss

    def step_loss(self, output, target):
        """The loss training_step returns: loss_fn plus, when asked, an auxiliary term on the output and an
        L2 regulariser on every parameter (the layers of every stage)."""
        loss = self.loss_fn(output, target)
        if self.aux and not self.aux_in_loss_fn:
            loss = loss + self.aux * output.pow(2).mean()
        if self.l2:
            loss = loss + self.l2 * sum(p.pow(2).sum() for p in self.parameters())
        return loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.step_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.log("val_loss", self.loss_fn(out, y), sync_dist=self.sync_dist)
        self.log("val_acc", (out.argmax(-1) == y).float().mean(), sync_dist=self.sync_dist)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(-1) + (x[:, 4] > 0).long()) % 4
    return TensorDataset(x, y)


def loader(batch_size: int = 16, n: int = 64) -> DataLoader:
    return DataLoader(dataset(n), batch_size=batch_size, shuffle=False)


def make_net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def sampler_epoch_order(epoch: int, n: int = 64) -> torch.Tensor:
    """The sample order of an epoch under torch's ``DistributedSampler(shuffle=True, seed=0)``, which
    Lightning installs for training: replica ``r`` of ``R`` takes ``order[r::R]``, so a step's batches
    across the replicas are together ``order[step * global_batch : (step + 1) * global_batch]``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch))


def reference_training(steps: int, batch_size: int = 16, seed: int = 0, *, shuffled: bool = False, **kwargs):
    """Plain single-process training of the same model on the same batches:
    (losses, final state dict, optimizer state dict). ``shuffled``: each epoch in
    :func:`sampler_epoch_order` (what data-parallel replicas see together), else in dataset order."""
    net = make_net(seed, **kwargs)
    opt = net.configure_optimizers()
    losses = []
    data = list(loader(batch_size))
    x_all, y_all = dataset().tensors
    for step in range(steps):
        if shuffled:
            epoch, i = divmod(step, len(data))
            idx = sampler_epoch_order(epoch)[i * batch_size:(i + 1) * batch_size]
            x, y = x_all[idx], y_all[idx]
        else:
            x, y = data[step % len(data)]
        opt.zero_grad()
        loss = net.step_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}, opt.state_dict()


class LossRecorder(L.Callback):
    """Keeps every training loss this rank logged."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
