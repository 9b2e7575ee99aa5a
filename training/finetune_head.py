"""Stage 6 (optional): fine-tune a trained DFlash2 head on short greedy continuations.

run_all.py trains the heads on 256-token continuations, where a small target soon settles into loops that are
easy to draft; real use (and evaluate.py) drafts mostly the first ~128 tokens after a prompt. This stage makes a
fresh distillation set of short continuations from many more prompts and continues training the head on it
(target frozen, same losses as train_dflash.py), then writes the head's tar like run_all.py does.

    python -m training.finetune_head --pack setup_wizard/bundled --head strata-nano-dflash2 --data training/data \
        --out OUT [--prompts 4096 --prompt-len 128 --new 128 --seconds 70 --lr 1e-3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from runtime.loading import load_target
from training import corpus
from training.common import Log, pick_device, seed_all, write_json
from training.configs import PRESETS
from training.distill import make_distill_set
from training.export import export_drafter, tar_folder
from training.train_dflash import build_drafter, drafter_state, train_dflash, window_acceptance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fine-tune a DFlash2 head on short greedy continuations.")
    ap.add_argument("--pack", type=Path, default=Path("setup_wizard/bundled"))
    ap.add_argument("--target", default="strata-nano")
    ap.add_argument("--head", default="strata-nano-dflash2")
    ap.add_argument("--data", type=Path, default=Path("training/data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("training/runs/finetune"))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="nano")
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=70.0)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    ap.add_argument("--anchors", type=int, default=None, help="anchors per sequence (default: the preset's)")
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    t0 = time.time()
    seed_all(args.seed)
    dev = pick_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "finetune.jsonl")
    preset = PRESETS[args.preset]
    data = corpus.load(args.data)
    model = load_target(args.pack / args.target, device="cpu", dtype=torch.float32).to(dev).eval()
    head_dir = args.pack / args.head
    cfg = json.loads((head_dir / "config.json").read_text())
    drafter = build_drafter(cfg, args.seed)
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(head_dir / "model.safetensors")).items()})
    s = dataclasses.replace(preset.dflash, seq=args.prompt_len + args.new, lr=args.lr, seconds=args.seconds, steps=args.steps,
                            warmup=20, block=int(cfg["dflash_config"]["block_size"]),
                            batch=args.batch or preset.dflash.batch, anchors=args.anchors or preset.dflash.anchors)
    seqs = make_distill_set(model, data["train"], args.prompts, args.prompt_len, args.new, dev, log,
                            seed=args.seed + 1, batch=1024)
    eval_seqs = make_distill_set(model, data["eval"], max(8, args.prompts // 24), args.prompt_len, args.new, dev, log,
                                 seed=args.seed + 2)
    before = window_acceptance(drafter.to(dev), model, eval_seqs, args.prompt_len, s.block, dev)
    log(stage="finetune", before=before)
    st = train_dflash(drafter, model, seqs, args.prompt_len, s, dev, log, seed=args.seed + 3, stage="finetune")
    st["before"] = before
    st["after"] = window_acceptance(drafter, model, eval_seqs, args.prompt_len, s.block, dev)
    log(stage="finetune", after=st["after"])
    export_drafter(drafter_state(drafter), args.work / args.head, cfg)
    tar_folder(args.work / args.head, args.out / f"{args.head}.tar")
    st.update(total_s=round(time.time() - t0, 1), sequences=int(seqs.shape[0]), settings=dataclasses.asdict(s))
    write_json(args.out / "finetune_metrics.json", st)
    print(json.dumps({k: st[k] for k in ("before", "after", "steps", "total_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
