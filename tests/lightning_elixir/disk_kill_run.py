"""One training run for the kill -9 test (tests/lightning_elixir/test_disk_kill.py), as its own process.

    python disk_kill_run.py ROOT MODE [KILL_IN_STEP]

MODE ``full``: 6 optimizer steps, a checkpoint every 2; ``resume``: from ROOT/ckpt/s4.ckpt to step 6.
KILL_IN_STEP: SIGKILL this process in that optimizer step (1-based), after its 10th chunk's write-back was
issued (mid-step: some chunks updated and on their way out, the rest not read yet). The final
local weights go to ROOT/<MODE>.pt.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_elixir.disk_state import DiskOptimizerState
    from tests.lightning_elixir.test_disk_tier import _disk_strategy, _fit

    root, mode = Path(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3:
        kill_in, seen = int(sys.argv[3]), [0]
        write = DiskOptimizerState._write

        def dying_write(self, chunk, s):  # type: ignore[no-untyped-def]
            write(self, chunk, s)
            if self.steps + 1 == kill_in:
                seen[0] += 1
                if seen[0] == 10:
                    os.kill(os.getpid(), signal.SIGKILL)

        DiskOptimizerState._write = dying_write  # type: ignore[method-assign]
    strategy = _disk_strategy(root / "disk")
    if mode == "full":
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="s{step}",
                               auto_insert_metric_name=False)
        _, weights, _ = _fit(strategy, root / "run", devices=1, callbacks=[ckpt], enable_checkpointing=True,
                             samples=16)
    else:
        _, weights, _ = _fit(strategy, root / "run", devices=1, ckpt_path=root / "ckpt" / "s4.ckpt", samples=16)
    torch.save(weights, root / f"{mode}.pt")


if __name__ == "__main__":
    main()
