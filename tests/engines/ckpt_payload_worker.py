"""A one-rank Megatron training engine that saves a real distributed checkpoint, or loads
checkpoints and reports what happened (run by test_checkpoint_payloads.py).

usage: ckpt_payload_worker.py save DIR          → DIR/train, DIR/params.safetensors
       ckpt_payload_worker.py load OUT.json DIR… → per DIR: loaded, error, params bitwise
(env: RANK=0, WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT)
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main() -> None:
    import torch
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.rl.config import TrainerConfig
    from tests.tiny_arch import tiny_arch

    arch = tiny_arch()
    engine = MegatronTrainEngine(arch, TrainerConfig(tp=1, lr=1e-3, seed=0))
    if sys.argv[1] == "save":
        out = Path(sys.argv[2])
        engine.load_weights(
            {k: v.clone() for k, v in create_model(arch, seed=5).state_dict().items()}
        )
        engine.save(out / "train")
        save_file(
            {f"p{i}": p.detach().clone() for i, p in enumerate(engine.params)},
            out / "params.safetensors",
        )
        return
    results = {}
    for d in map(Path, sys.argv[3:]):
        want = load_file(d / "params.safetensors")
        with torch.no_grad():
            for p in engine.params:
                p.zero_()
        try:
            engine.load(d / "train")
            results[str(d)] = {
                "loaded": True,
                "bitwise": all(torch.equal(p, want[f"p{i}"]) for i, p in enumerate(engine.params)),
            }
        except Exception as exc:  # what a refused load raises, reported for the test
            results[str(d)] = {"loaded": False, "error": f"{type(exc).__name__}: {exc}"}
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
