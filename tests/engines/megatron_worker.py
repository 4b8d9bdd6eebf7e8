"""One rank of the Megatron engine checks (run by test_megatron_engine.py as a subprocess).

usage: megatron_worker.py OUT_DIR   (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
World size = TP size. Every rank builds the same HF model, loads it into the TP-sharded
GPTModel and checks logits, conversion, GRPO/SFT steps, offload and dist-checkpoint
round trips. Rank 0 writes results.json and the trained canonical weights.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.rl.config import TrainerConfig
    from tests.tiny_arch import tiny_arch

    out = Path(sys.argv[1])
    tp = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    arch = tiny_arch()
    hf = create_model(arch, seed=5)
    canonical = {k: v.clone() for k, v in hf.state_dict().items()}
    res: dict = {"tp": tp}

    def engine(seed: int = 0) -> MegatronTrainEngine:
        return MegatronTrainEngine(
            arch, TrainerConfig(tp=tp, lr=1e-3, seed=seed, grad_clip=1.0, micro_batch_size=3)
        )

    e = engine()
    from pivot_hpc.engines.base import TrainEngine

    res["is_train_engine"] = isinstance(e, TrainEngine)  # every member of the contract
    e.load_weights(canonical)
    ids = torch.randint(3, 99, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ref_logits = hf(ids).logits.float()
    res["logits_max_diff"] = (e.forward_logits(ids) - ref).abs().max().item()
    exported = e.export_weights()
    res["export_bitwise"] = all(torch.equal(exported[k], v) for k, v in canonical.items())

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    responses = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (6, 2, 8, 4)]
    batch = TrainBatch(
        prompt_ids=prompts, response_ids=responses, advantages=[1.0, -0.5, 0.3, -0.8]
    )
    lps = e.compute_logprobs(batch, temperature=1.0)
    worst = 0.0
    with torch.no_grad():
        for p, r, lp in zip(prompts, responses, lps, strict=True):
            full = torch.log_softmax(hf(torch.tensor([p + r])).logits[0].float(), -1)
            want = full[len(p) - 1 : len(p) + len(r) - 1].gather(1, torch.tensor(r)[:, None])[:, 0]
            worst = max(worst, (want - torch.tensor(lp)).abs().max().item())
    res["logprob_max_diff"] = worst
    batch.old_logprobs = lps
    # rollout/trainer mismatch correction: with rollout logprobs equal to the trainer's the
    # recomputing engine (TIS on) takes exactly the plain engine's step
    from pivot_hpc.rl.config import GRPOConfig

    def grpo_engine(**kw) -> MegatronTrainEngine:
        eng = MegatronTrainEngine(
            arch,
            TrainerConfig(tp=tp, lr=1e-3, grad_clip=1.0, micro_batch_size=3),
            GRPOConfig(**kw),
            max_response_tokens=8,
        )
        eng.load_weights(canonical)
        return eng

    tis = grpo_engine(recompute_old_logprobs=True, rollout_is="truncate", rollout_is_threshold=2.0)
    res["tis_metrics"] = tis.train_step(batch)
    ref = grpo_engine()
    ref.train_step(batch)
    res["tis_same_step"] = all(
        torch.equal(a, b) for a, b in zip(tis.params, ref.params, strict=True)
    )
    # rl.trainer.attention=sdpa and rl.trainer.recompute: the same function as the local
    # spec (logits, and the step a GRPO update takes), in less memory on a GPU
    for attention, recompute in (("sdpa", "none"), ("local", "selective"), ("sdpa", "full")):
        variant = MegatronTrainEngine(
            arch,
            TrainerConfig(
                tp=tp,
                lr=1e-3,
                grad_clip=1.0,
                micro_batch_size=3,
                attention=attention,
                recompute=recompute,
            ),
            GRPOConfig(),
            max_response_tokens=8,
        )
        variant.load_weights(canonical)
        name = f"{attention}_{recompute}"
        res[f"{name}_logits_max_diff"] = (
            (variant.forward_logits(ids) - ref_logits).abs().max().item()
        )
        variant.train_step(batch)
        res[f"{name}_step_max_diff"] = max(
            (a - b).abs().max().item() for a, b in zip(variant.params, ref.params, strict=True)
        )
    noisy = [[x + 0.5 * (-1) ** t for t, x in enumerate(lp)] for lp in lps]
    masked = grpo_engine(recompute_old_logprobs=True, rollout_is="mask", rollout_is_threshold=1.5)
    res["mis_metrics"] = masked.train_step(
        TrainBatch(
            prompt_ids=prompts,
            response_ids=responses,
            advantages=batch.advantages,
            old_logprobs=noisy,
            truncated=[False, False, True, False],
        )
    )
    # a user's loss (rl.grpo.loss_fn): called per micro-batch with the documented keywords
    from tests.engines import custom_loss

    res["custom_pg_loss"] = grpo_engine(
        loss_fn="tests.engines.custom_loss:doubled_loss"
    ).train_step(batch)["pg_loss"]
    res["default_pg_loss"] = grpo_engine().train_step(batch)["pg_loss"]
    res["custom_calls"] = len(custom_loss.CALLS)
    res["custom_kwargs"] = custom_loss.CALLS[0]
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        res[f"agg_{mode}"] = grpo_engine(loss_agg_mode=mode).train_step(batch)["pg_loss"]
    res.update(loss_mask_checks(arch, tp, canonical, hf, prompts, responses, lps))
    m1 = e.train_step(batch)
    m2 = e.train_step(batch, loss="sft")
    res["grpo_metrics"] = m1
    res["sft_metrics"] = m2
    trained = e.export_weights()
    res["weights_changed"] = any(not torch.equal(trained[k], canonical[k]) for k in canonical)
    # after training, conversion still agrees: HF model with exported weights == Megatron
    hf.load_state_dict(trained)
    with torch.no_grad():
        ref2 = hf(ids).logits.float()
    res["trained_logits_max_diff"] = (e.forward_logits(ids) - ref2).abs().max().item()

    # optimizer offload: state leaves the optimizer and training continues bit-exactly
    ckpt = out / "ckpt"
    e.save(ckpt)
    # no helper process outlives a save (megatron's spawn-context results queue)
    res["save_children"] = [p.name for p in multiprocessing.active_children()]
    e2 = engine(seed=9)
    e2.load(ckpt)
    same_params = all(torch.equal(a, b) for a, b in zip(e.params, e2.params, strict=True))
    same_opt = all(
        torch.equal(e.optimizer.state[p][k], e2.optimizer.state[q][k])
        for p, q in zip(e.params, e2.params, strict=True)
        for k in ("exp_avg", "exp_avg_sq", "step")
    )
    res["ckpt_params_bitwise"] = same_params
    res["ckpt_optimizer_bitwise"] = same_opt
    res["ckpt_counters"] = [e2.steps, e2.version]
    e2.offload_optimizer()
    res["offloaded_state_entries"] = len(e2.optimizer.state)
    e.train_step(batch)
    e2.train_step(batch)  # reloads the offloaded state first
    res["continue_bitwise"] = all(
        torch.equal(a, b) for a, b in zip(e.params, e2.params, strict=True)
    )
    # parameters off the device (a GPU shift down): freed, then refilled from the weights
    # GPS would hold, and the next step is the same bit for bit
    published = e2.export_weights()
    e2.offload_optimizer()
    e2.release_memory()
    res["released_numel"] = sum(p.numel() for p in e2.params)
    e2.resume_memory()
    e2.load_weights(published)
    e.train_step(batch)
    e2.train_step(batch)
    res["release_continue_bitwise"] = all(
        torch.equal(a, b) for a, b in zip(e.params, e2.params, strict=True)
    )
    final = e.export_weights()
    if rank == 0:
        torch.save(final, out / "final_weights.pt")
        (out / "results.json").write_text(json.dumps(res))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def loss_mask_checks(arch, tp, canonical, hf, prompts, responses, lps) -> dict:
    """Multi-turn loss mask (issue 37) on the Megatron path: the gradient equals the GRPO
    reference's (HF logprobs → rl/grpo.ppo_clip_loss over the generated tokens), the
    observations' placeholder logprobs change nothing, an all-ones mask is no mask."""
    import torch

    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
    from pivot_hpc.rl.config import GRPOConfig, TrainerConfig
    from pivot_hpc.rl.grpo import ppo_clip_loss

    # masked middle segments in sequences 0 and 2: 13 of the 20 response tokens in the loss
    mask = [[1, 1, 0, 0, 0, 1], [1, 1], [1, 0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1]]
    adv = [1.0, -0.5, 0.3, -0.8]
    # off-policy enough that the clip is active somewhere: ratio != 1
    old = [[x + 0.15 * (-1) ** t for t, x in enumerate(lp)] for lp in lps]
    ref = [[x - 0.3 for x in lp] for lp in lps]

    def placeholders(rows, v):
        return [
            [v if k == 0 else x for x, k in zip(r, m, strict=True)]
            for r, m in zip(rows, mask, strict=True)
        ]

    def batch(loss_mask, v=None):
        # v: the rollout's placeholder at the observation tokens of `mask`
        o, r = (old, ref) if v is None else (placeholders(old, v), placeholders(ref, v))
        return TrainBatch(
            prompt_ids=prompts,
            response_ids=responses,
            advantages=adv,
            old_logprobs=o,
            ref_logprobs=r,
            loss_mask=loss_mask,
        )

    def step(b):
        eng = MegatronTrainEngine(
            arch,
            TrainerConfig(tp=tp, lr=1e-3, grad_clip=0.0, micro_batch_size=3),
            GRPOConfig(kl_coef=0.1),
            max_response_tokens=8,
        )
        eng.load_weights(canonical)
        metrics = eng.train_step(b)
        grads = eng._canonical({n: p.main_grad.view_as(p) for n, p in eng.gpt.named_parameters()})
        return eng, metrics, grads

    out: dict = {}
    e0, m0, g0 = step(batch(mask, v=0.0))
    e1, _, g1 = step(batch(mask, v=-1.0e4))  # exp overflows there: must stay out
    out["mask_placeholder_bitwise"] = all(
        torch.equal(a, b) for a, b in zip(e0.params, e1.params, strict=True)
    ) and all(torch.equal(g0[k], g1[k]) for k in g0)
    ones = [[1] * len(r) for r in responses]
    e2, _, _ = step(batch(None))
    e3, _, _ = step(batch(ones))
    out["mask_ones_bitwise"] = all(
        torch.equal(a, b) for a, b in zip(e2.params, e3.params, strict=True)
    )
    # the reference: HF model, same weights, the loss summed over sequences / 13 tokens
    model = hf.__class__(hf.config)
    model.load_state_dict(canonical)
    model.zero_grad()
    n_tok = sum(map(sum, mask))
    pg = kl = 0.0
    for p, r, m, a, o, rf in zip(prompts, responses, mask, adv, old, ref, strict=True):
        lp = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float(), -1)
        lp = lp[len(p) - 1 : len(p) + len(r) - 1].gather(1, torch.tensor(r)[:, None])[:, 0]
        value, parts = ppo_clip_loss(
            lp[None],
            torch.tensor([o]),
            torch.tensor([a]),
            torch.tensor([m], dtype=torch.float32),
            kl_coef=0.1,
            ref_logprobs=torch.tensor([rf]),
            normalizer=n_tok,
        )
        value.backward()
        pg += float(parts["pg_loss_sum"])
        kl += float(parts["kl_sum"])
    want = {n: t.grad for n, t in model.named_parameters()}
    scale = max(float(w.abs().max()) for w in want.values())
    out["mask_grad_max_diff"] = max(float((g0[n] - want[n]).abs().max()) for n in want) / scale
    out["mask_tokens"] = [m0["tokens"], float(n_tok)]
    out["mask_pg_loss"] = [m0["pg_loss"], pg / n_tok]
    out["mask_kl"] = [m0["kl"], kl / n_tok]
    return out


if __name__ == "__main__":
    main()
