"""Functions each spawned rank runs (module level, so ``run_distributed`` can spawn them)."""

from __future__ import annotations

import lightning as L

import sky_strategy
from tests.sky_strategy.models import LossRecorder, loader, make_net


def portable(state: dict) -> dict:
    """Tensors -> numpy arrays: results cross the process boundary by value (a torch tensor would be
    shared through a file descriptor that dies with the rank)."""
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def trainer(world: int, strategy, steps: int, callbacks=(), **kwargs) -> L.Trainer:
    kwargs.setdefault("use_distributed_sampler", False)
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=2, callbacks=list(callbacks), **kwargs)


def several(rank: int, world: int, calls: list[tuple[str, tuple]]) -> list:
    """Each ``(name of a function of this module, its arguments)`` of ``calls`` in turn, on this one process group:
    the tests of one world size share their ranks (each spawned rank imports torch and Lightning anew, which costs
    more than most of these runs). Every run builds its own strategy, Trainer and seeded model (``make_net``)."""
    return [globals()[name](rank, world, *args) for name, args in calls]


def fit_configs(rank: int, world: int, configs: list[dict], steps: int, net_kwargs: dict | None = None) -> list[dict]:
    """Train a fresh model under each config in turn (one process group); report what each rank saw."""
    out = []
    for cfg in configs:
        strategy = sky_strategy.SkyStrategy(verbose=False, **cfg)
        rec = LossRecorder()
        t = trainer(world, strategy, steps, [rec])
        net = make_net(**(net_kwargs or {}))
        t.fit(net, loader())
        state = portable(strategy.lightning_module_state_dict())
        logged = float(t.callback_metrics["train_loss"])
        metrics = t.validate(net, loader(), verbose=False)[0]
        out.append({"losses": rec.losses, "state": state, "counts": strategy.plan.layer_counts(),
                    "plan": strategy.plan.to_json(), "logged": logged, "val": metrics,
                    "replans": list(strategy.replans)})
    return out


def fit_extra_terms(rank: int, world: int, configs: list[tuple[dict, dict]], steps: int) -> list[dict]:
    """Train each (strategy config, model kwargs) pair: a training_step loss with terms beyond loss_fn."""
    out = []
    for cfg, net_kwargs in configs:
        strategy = sky_strategy.SkyStrategy(verbose=False, **cfg)
        rec = LossRecorder()
        t = trainer(world, strategy, steps, [rec])
        t.fit(make_net(**net_kwargs), loader())
        out.append({"losses": rec.losses, "state": portable(strategy.lightning_module_state_dict()),
                    "logged": float(t.callback_metrics["train_loss"]), "second_passes": strategy.second_passes})
    # a term mixing the output with the first stage's weights cannot be split by rank: refused, not mis-trained
    net = make_net()

    def coupled(batch, batch_idx, net=net):
        x, y = batch
        out = net(x)
        return net.loss_fn(out, y) + 1e-2 * out.mean() * net.embed.weight.sum()
    net.training_step = coupled
    try:
        trainer(world, sky_strategy.SkyStrategy(verbose=False, microbatches=4, partition="even"), 1).fit(net, loader())
        out.append("no error")
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    return out


class CollectiveCounter(L.Callback):
    """Counts the elements every collective except the pipeline's own send/recv moved during one training
    batch, read from the PyTorch profiler's record of the gloo calls (``gloo:broadcast [[n]]``...)."""

    def __init__(self, batch: int):
        self.batch, self.counts, self._prof = batch, {}, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self._prof.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.batch and self._prof is not None:
            import math

            self._prof.__exit__(None, None, None)
            for e in self._prof.events():
                if e.name.startswith("gloo:") and e.name not in ("gloo:send", "gloo:recv"):
                    elements = sum(math.prod(shape) for shape in e.input_shapes if shape)
                    self.counts[e.name] = self.counts.get(e.name, 0) + elements


def collective_elements(rank: int, world: int, classes: list[int], aux: float) -> list[dict]:
    """Elements moved by collectives in the 4th training batch, for each output width."""
    out = []
    for n in classes:
        counter = CollectiveCounter(batch=3)
        t = trainer(world, sky_strategy.SkyStrategy(verbose=False, microbatches=4), 4, [counter])
        t.fit(make_net(classes=n, aux=aux), loader())
        out.append(counter.counts)
    return out


def fit_replicas(rank: int, world: int, configs: list[dict], steps: int, path: str) -> list[dict]:
    """Data-parallel replicas of the pipeline: each config trains a fresh model on a local batch of 8
    (Lightning's distributed sampler splits the data by replica), logs with sync_dist, validates, and
    the first one saves a checkpoint to ``path``."""
    out = []
    for i, cfg in enumerate(configs):
        strategy = sky_strategy.SkyStrategy(verbose=False, **cfg)
        rec = LossRecorder()
        t = trainer(world, strategy, steps, [rec], use_distributed_sampler=True)
        net = make_net(sync_dist=True)
        t.fit(net, loader(batch_size=8))
        if i == 0:
            t.save_checkpoint(path)
        out.append({"losses": rec.losses, "state": portable(strategy.lightning_module_state_dict()),
                    "counts": strategy.plan.layer_counts(), "logged": float(t.callback_metrics["train_loss"]),
                    "val": t.validate(net, loader(batch_size=8), verbose=False)[0],
                    "layout": (strategy.replicas, strategy.pipeline_ranks, strategy.replica_rank,
                               strategy.pipeline_rank)})
    return out


def checkpoint_round_trip(rank: int, world: int, path: str, first: dict, second: dict) -> dict:
    """Train 4 steps (one epoch) under ``first``, save, resume under ``second`` (another partition) to 8."""
    # whole epochs (4 batches each): Lightning resumes a checkpoint saved mid-epoch at the next batch
    # index but restarts a plain dataloader from its first batch, so a mid-epoch file would not line up
    s1 = sky_strategy.SkyStrategy(verbose=False, **first)
    t1 = trainer(world, s1, -1, max_epochs=1)
    t1.fit(make_net(), loader())
    t1.save_checkpoint(path)
    counts1 = s1.plan.layer_counts()
    s2 = sky_strategy.SkyStrategy(verbose=False, **second)
    t2 = trainer(world, s2, -1, max_epochs=2)
    t2.fit(make_net(seed=123), loader(), ckpt_path=path)  # another init: everything must come from the file
    return {"state": portable(s2.lightning_module_state_dict()), "counts": (counts1, s2.plan.layer_counts()),
            "owned": sorted(n for i, layer in enumerate(s2.runtime.layers) if s2.runtime.owns(i)
                            for n, p in layer.parameters() if p.numel())}


class SlowDownAt(L.Callback):
    """After ``step`` optimizer steps, the ranks start playing devices of speeds ``factors``."""

    def __init__(self, step: int, factors: list[float]):
        self.step, self.factors = step, factors

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.set_speed_factors(self.factors)


def replan_run(rank: int, world: int, steps: int, factors: tuple = (1.0, 0.1), data_parallel: int = 1) -> dict:
    strategy = sky_strategy.SkyStrategy(verbose=False, schedule="1f1b", microbatches=4, replan_every=2,
                                        replan_threshold=0.5, data_parallel=data_parallel)
    replicas = data_parallel > 1  # replicas: Lightning's sampler splits (and shuffles) a local batch of 8
    t = trainer(world, strategy, steps, [SlowDownAt(2, list(factors))], use_distributed_sampler=replicas)
    t.fit(make_net(width=96), loader(batch_size=8 if replicas else 16))
    return {"state": portable(strategy.lightning_module_state_dict()), "replans": strategy.replans,
            "counts": strategy.plan.layer_counts()}


class BatchesStarted(L.Callback):
    def __init__(self):
        self.count = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.count += 1


def misuse(rank: int, world: int, cases: list[str]) -> dict[str, str]:
    """Run each misconfiguration in turn; return the error message of each."""
    out = {}
    for case in cases:
        net = make_net()
        kwargs = {}
        if case == "forward":
            net.forward = lambda x, net=net: net.head(net.embed(x))  # skips the blocks: not the declared sequence
        elif case == "clip":
            kwargs = {"gradient_clip_val": 1.0}
        elif case == "no-layers":
            net.pipeline_layers = ("embed", "head")  # the blocks' parameters belong to no layer
        elif case == "tied":
            net.blocks[1].fc.weight = net.blocks[0].fc.weight
        elif case == "manual":
            net.automatic_optimization = False
        replicas = {"data_parallel": 2} if case == "replicas" else {}  # 1 rank cannot hold 2 replicas
        started = BatchesStarted()
        try:
            t = trainer(world, sky_strategy.SkyStrategy(verbose=False, microbatches=2, **replicas), 1,
                        callbacks=[started], **kwargs)
            t.fit(net, loader())
            if case == "predict":
                t.predict(net, loader())
            out[case] = "no error"
        except Exception as exc:  # the message is what the test checks
            out[case] = f"{type(exc).__name__}: {exc} [batches started: {started.count}]"
    return out
