"""Children of ``benchmarks/memory_limits.py``: each runs one case as a user would and prints one JSON line.

    python -m benchmarks._memory_limit_cases energon MODEL_DIR          # Engine.from_pretrained, no budget
    python -m benchmarks._memory_limit_cases serve MODEL_DIR            # `tightfit serve MODEL_DIR`, no budget
    python -m benchmarks._memory_limit_cases elixir WORK_DIR            # Trainer(strategy=ElixirStrategy(disk_dir))

A refusal (the plan does not fit) prints ``{"refused": ...}`` and exits with code 3.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

#: The energon case: a LLaMA of 16 layers x 2048 (GQA 16 / 4, MLP 4096, vocabulary 32000), fp32: 2.8 GB.
ENERGON_MODEL = dict(vocab=32000, hidden=2048, layers=16, heads=16, kv_heads=4, intermediate=4096, max_positions=2048)
ENERGON_PROMPTS = [[1, 5, 9, 300, 42], [7, 8, 9]]
ENERGON_TOKENS = 4

#: The Elixir case: Hugging Face GPT-2 of ~240M parameters (its fp32 AdamW state ~3.9 GB), batch 1 x 128, 3 steps.
ELIXIR_GPT: dict[str, Any] = dict(n_embd=1024, n_layer=15, n_head=16, vocab_size=50257, n_positions=1024)
ELIXIR_STEPS, ELIXIR_SEQ = 3, 128


def energon(model: str) -> None:
    from energon_infer import Engine, SamplingParams
    from tightfit.planner.errors import PlanInfeasibleError

    start = time.perf_counter()
    try:
        with Engine.from_pretrained(model, progress=False) as engine:
            outs = engine.generate(ENERGON_PROMPTS, SamplingParams(temperature=0, max_tokens=ENERGON_TOKENS,
                                                                    ignore_eos=True))
            plan = engine.memory_plan
            explain = engine.explain()
    except PlanInfeasibleError as err:
        print(json.dumps({"refused": str(err)}))
        sys.exit(3)
    print(json.dumps({"tokens": [o.token_ids for o in outs], "seconds": time.perf_counter() - start,
                      "explain": explain, "streams": bool(plan is not None and plan.streams)}))


def serve(model: str) -> None:
    """``tightfit serve MODEL`` started as a user would (this client is in the same memory limit), asked for the
    prompts' greedy tokens over HTTP, then stopped."""
    import signal
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("tightfit")), "serve", model, "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read() if proc.stdout else ""
                line = next((ln for ln in out.splitlines() if ln.startswith("tightfit serve:")), out[-500:])
                print(json.dumps({"refused": line, "returncode": proc.returncode}))
                sys.exit(3)
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        ready = time.perf_counter() - start
        tokens = []
        for prompt in ENERGON_PROMPTS:
            body = json.dumps({"prompt": prompt, "max_tokens": ENERGON_TOKENS, "temperature": 0, "logprobs": 1,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=900) as r:
                got = json.loads(r.read())["choices"][0]["logprobs"]["tokens"]
            tokens.append([int(t.removeprefix("token_id:")) for t in got])
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start, "ready_seconds": ready}))


def elixir(work: str) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_elixir import ElixirStrategy

    cfg = GPT2Config(**ELIXIR_GPT)
    tokens = torch.randint(0, cfg.vocab_size, (ELIXIR_STEPS, ELIXIR_SEQ + 1), generator=torch.Generator().manual_seed(0))
    losses: list[float] = []

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: GPT2LMHeadModel | None = None

        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                self.model = GPT2LMHeadModel(cfg)

        def training_step(self, batch, i):
            x, y = batch
            assert self.model is not None
            return F.cross_entropy(self.model(input_ids=x).logits.reshape(-1, cfg.vocab_size), y.reshape(-1))

        def on_train_batch_end(self, out, batch, i) -> None:
            losses.append(float(out["loss"].item()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)

    disk = Path(work) / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    strategy = ElixirStrategy(disk_dir=disk)
    start = time.perf_counter()
    try:
        L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=ELIXIR_STEPS, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=work).fit(Model())
    except Exception as err:  # the strategy's refusal: one line
        print(json.dumps({"refused": f"{type(err).__name__}: {err}"}))
        sys.exit(3)
    print(json.dumps({"losses": losses, "seconds": time.perf_counter() - start, "explain": strategy.plan.explain()}))


if __name__ == "__main__":
    {"energon": energon, "serve": serve, "elixir": elixir}[sys.argv[1]](sys.argv[2])
