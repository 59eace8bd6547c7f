"""The example GPT (tightfit.models) served from a real Lightning training checkpoint."""

from __future__ import annotations

import pickle

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams, load_tightfit_gpt
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf
from tightfit.models import GPTConfig, build_gpt

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(40, 90))]


def _train_lightning_checkpoint(path, **model_kwargs):
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self, preset: str = "gpt2-tiny", **overrides):
            super().__init__()
            self.save_hyperparameters()
            self.model = build_gpt(preset, **overrides)

        def training_step(self, batch, _):
            return self.model.loss(batch[:, :-1], batch[:, 1:])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randint(0, 256, (8, 33)), batch_size=4)
    module = LitGPT(**model_kwargs)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(path.parent))
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    return module.model.eval()


@torch.no_grad()
def _reference(model):
    return torch.cat([model(torch.tensor([p]))[0] for p in PROMPTS])


@RunIf(lightning=True)
def test_lightning_checkpoint_serves_the_trained_model(tmp_path):
    ckpt = tmp_path / "last.ckpt"
    model = _train_lightning_checkpoint(ckpt, layers=3)  # preset + override in hyper_parameters
    runner = load_tightfit_gpt(ckpt, block_size=8, progress=False)
    assert runner.config.n_layers == 3 and runner.config.vocab_size == 256
    assert (runner.forward(list(enumerate(PROMPTS)), all_logits=True) - _reference(model)).abs().max().item() <= 1e-4
    gen = runner.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))[0]  # byte tokenizer for 256 tokens
    assert gen.prompt_token_ids == list(b"hello") and len(gen.token_ids) == 4
    # The same model, tensor parallel over two ranks.
    out = run_distributed(_tp2, 2, args=(str(ckpt), _reference(model)), timeout=300)
    assert out[0] == out[1] and out[0] <= 1e-4


def _tp2(rank, world, ckpt, ref):
    runner = load_tightfit_gpt(ckpt, tp=2, progress=False)
    return (runner.forward(list(enumerate(PROMPTS)), all_logits=True) - ref).abs().max().item()


def test_state_dict_files_need_heads_or_a_config(tmp_path):
    cfg = GPTConfig(vocab_size=97, n_positions=64, hidden=32, layers=2, heads=4, tie_embeddings=False)
    torch.manual_seed(1)
    model = build_gpt(cfg).eval()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"cannot tell the number of attention heads.*pass heads=N"):
        load_tightfit_gpt(tmp_path / "model.pt", progress=False)
    runner = load_tightfit_gpt(tmp_path / "model.pt", heads=4, progress=False)
    assert runner.tokenizer is None and runner.config.tie_embeddings is False
    assert (runner.forward(list(enumerate(PROMPTS[:2])), all_logits=True)
            - torch.cat([model(torch.tensor([p]))[0] for p in PROMPTS[:2]]).detach()).abs().max().item() <= 1e-4
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    same = load_tightfit_gpt(tmp_path / "model.safetensors", gpt_config=cfg, progress=False)
    assert isinstance(same, ModelRunner) and same.config.n_heads == 4


def test_checkpoints_that_need_unpickling_code_are_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    with open(tmp_path / "evil.ckpt", "wb") as f:
        pickle.dump({"state_dict": {}, "x": Evil()}, f)
    with pytest.raises(ValueError, match="loading them would mean running arbitrary code"):
        load_tightfit_gpt(tmp_path / "evil.ckpt", progress=False)
    torch.save({"state_dict": {"encoder.weight": torch.zeros(2)}}, tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match="no 'wte.weight' tensor, so it is not a tightfit.models GPT checkpoint"):
        load_tightfit_gpt(tmp_path / "other.ckpt", progress=False)
