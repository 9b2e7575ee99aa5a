"""Retrain the pack's default DFlash2 head at another geometry against the pinned target (one GPU call, ~5 min).

    python -m training.train_head --data training/data --out OUT [--layers 1] [--inter 256] [--seconds 170]

Why: the head's cost relative to the target decides whether drafting pays. The first pack's head (5 layers of
width 256) costs about as much as its 6-layer target on a CPU, where real deployments draft with 5 layers for a
48-layer target; a head of one or two layers has that ratio. The recipe is run_all.py's stages 2 and 4 plus
finetune_head.py (stage 6) for one head, with the target frozen (the pinned `setup_wizard/bundled/strata-nano`):
1. distillation set: the target's greedy continuations (256 new tokens) of corpus train prompts;
2. the head from scratch on it (block 8, the preset's losses), `--seconds` x `--split` of the training time;
3. short continuations (128 new tokens) of more prompts, and the rest of the time fine-tuning on them;
4. evaluation: tokens per window on held-out continuations (the training proxy) before/after step 3, and through
   the runtime's own speculative loop on evaluate.py's held-out prompts (greedy, blocks 4/6/8, each output checked
   against the target alone).
Writes OUT/strata-nano-dflash2.tar (the head folder: config.json + model.safetensors), OUT/train_head.json and
OUT/train_head.jsonl (the log). Unpack into setup_wizard/bundled/ (training.export.untar_safely), then
`python -m training.pin` (training/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from runtime.loading import load_target
from training import corpus
from training.common import Log, pick_device, seed_all, write_json
from training.configs import PRESETS, dflash_config
from training.distill import make_distill_set
from training.export import export_drafter, tar_folder
from training.train_dflash import build_drafter, drafter_state, train_dflash, window_acceptance

BUNDLED = Path(__file__).resolve().parent.parent / "setup_wizard" / "bundled"
TARGET, DRAFT = "strata-nano", "strata-nano-dflash2"


def runtime_acceptance(target_dir: Path, head_dir: Path, device: str, n_prompts: int, max_new: int,
                       blocks: tuple[int, ...]) -> dict:
    """Tokens per window through the runtime's loop on the held-out prompts of training/evaluate.py."""
    from runtime.engine import Engine
    from training.evaluate import held_out_sources, make_prompts, run_variant

    base = Engine.build(target_dir, "none", device=device, context=2048)
    prompts = make_prompts(base.tokenizer, held_out_sources(), n_prompts, 256)
    out: dict = {"prompts": len(prompts), "max_new_tokens": max_new}
    eng = Engine.build(target_dir, "dflash2", drafter_path=head_dir, device=device, context=2048)
    for b in blocks:
        # the reference at the same step width (docs/models.md, "Numerics"): the same engine, drafting off
        ref = [eng.generate(p, max_new_tokens=max_new, draft=False, width=b).token_ids for p in prompts]
        v = run_variant(eng, prompts, max_new, b, ref)
        v.pop("outputs", None)
        out[f"block {b}"] = v
    del base, eng
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Retrain the default DFlash2 head at another geometry.")
    ap.add_argument("--data", type=Path, default=Path("training/data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bundled", type=Path, default=BUNDLED)
    ap.add_argument("--work", type=Path, default=Path("/tmp/train_head"))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--inter", type=int, default=256, help="the head's MLP width")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=170.0, help="training time of both phases together")
    ap.add_argument("--split", type=float, default=0.55, help="share of --seconds for the from-scratch phase")
    ap.add_argument("--long-prompts", type=int, default=2048)
    ap.add_argument("--short-prompts", type=int, default=4096)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="nano")
    ap.add_argument("--seed", type=int, default=2468)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    if not (args.data / "corpus.npz").is_file():
        print(f"{args.data} has no corpus.npz; build it first with `python -m training.corpus --out {args.data}`.")
        return 2
    if not (args.bundled / TARGET / "config.json").is_file():
        print(f"{args.bundled} holds no {TARGET} folder; pass --bundled with the pack's folder.")
        return 2
    t0 = time.time()
    seed_all(args.seed)
    dev = pick_device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "train_head.jsonl")
    preset = PRESETS[args.preset]
    g = dataclasses.replace(preset.geometry, d_layers=args.layers, d_inter=args.inter)
    cfg = dflash_config(g, args.block)
    data = corpus.load(args.data)
    model = load_target(args.bundled / TARGET, device="cpu", dtype=torch.float32).to(dev).eval()
    plen = preset.distill_prompt_len
    metrics: dict = {"geometry": {"layers": args.layers, "intermediate": args.inter, "block": args.block},
                     "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "seed": args.seed}

    # 1. long continuations (run_all.py stage 2) and a held-out set for the proxy
    t = time.time()
    seqs = make_distill_set(model, data["train"], args.long_prompts, plen, preset.distill_new, dev, log,
                            seed=args.seed + 1, batch=1024)
    eval_seqs = make_distill_set(model, data["eval"], max(8, args.long_prompts // 24), plen, preset.distill_new,
                                 dev, log, seed=args.seed + 2)
    metrics["distill_long"] = {"sequences": int(seqs.shape[0]), "seconds": round(time.time() - t, 1)}

    # 2. the head from scratch (run_all.py stage 4)
    drafter = build_drafter(cfg, args.seed + 10)
    s1 = dataclasses.replace(preset.dflash, block=args.block, seconds=args.seconds * args.split)
    metrics["scratch"] = train_dflash(drafter, model, seqs, plen, s1, dev, log, seed=args.seed + 20, stage="scratch")
    metrics["scratch"]["acceptance"] = window_acceptance(drafter, model, eval_seqs, plen, args.block, dev)
    log(stage="scratch", acceptance=metrics["scratch"]["acceptance"])

    # 3. short continuations and the fine-tune (finetune_head.py)
    t = time.time()
    short = make_distill_set(model, data["train"], args.short_prompts, plen, 128, dev, log, seed=args.seed + 3,
                             batch=1024)
    short_eval = make_distill_set(model, data["eval"], max(8, args.short_prompts // 24), plen, 128, dev, log,
                                  seed=args.seed + 4)
    metrics["distill_short"] = {"sequences": int(short.shape[0]), "seconds": round(time.time() - t, 1)}
    s2 = dataclasses.replace(preset.dflash, seq=plen + 128, lr=1e-3, warmup=20, block=args.block,
                             seconds=args.seconds * (1 - args.split))
    before = window_acceptance(drafter, model, short_eval, plen, args.block, dev)
    metrics["finetune"] = train_dflash(drafter, model, short, plen, s2, dev, log, seed=args.seed + 30,
                                       stage="finetune")
    metrics["finetune"].update(before=before, after=window_acceptance(drafter, model, short_eval, plen, args.block,
                                                                      dev))
    log(stage="finetune", before=before, after=metrics["finetune"]["after"])

    export_drafter(drafter_state(drafter), args.work / DRAFT, cfg)
    tar_folder(args.work / DRAFT, args.out / f"{DRAFT}.tar")
    write_json(args.out / "train_head.json", metrics)

    # 4. the runtime's loop on held-out prompts (greedy, lossless-checked)
    t = time.time()
    metrics["runtime"] = runtime_acceptance(args.bundled / TARGET, args.work / DRAFT, dev.type, args.eval_prompts,
                                            128, (4, 6, 8))
    metrics["runtime"]["seconds"] = round(time.time() - t, 1)
    metrics["total_s"] = round(time.time() - t0, 1)
    write_json(args.out / "train_head.json", metrics)
    summary = {k: {"tokens_per_window": round(v["tokens_per_window"], 3), "equal_to_target": v["equal_to_target"]}
               for k, v in metrics["runtime"].items() if k.startswith("block")}
    print(json.dumps({"total_s": metrics["total_s"], "proxy_after": metrics["finetune"]["after"], "runtime": summary}))
    return 0 if all(v["equal_to_target"] for v in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
