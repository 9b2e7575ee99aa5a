"""Build the whole strata-nano pack in one go (the GPU recipe; `--preset toy` runs the same path on CPU in seconds).

    python -m training.run_all --preset nano --data training/data --out OUT [--resume DIR] [--deadline-s 570]

Stages: target + MTP (corpus) -> held-out perplexity -> distillation set (the target's greedy continuations) ->
MTP fine-tune -> DFlash2 head (block 8) -> DFlash2 turbo head (block 16, longer) -> acceptance on held-out
continuations. Each finished stage is written to OUT at once as one tar per shipped folder
(`strata-nano.tar`, `strata-nano-dflash2.tar`, `strata-nano-dflash2-turbo.tar`), plus `log.jsonl` and
`metrics.json`, so a call that is cut short still returns what it finished; `--resume DIR` (a folder holding
those tars) skips the finished stages. Stage time limits shrink to fit `--deadline-s` of wall time.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from runtime.loading import load_target
from training import corpus
from training.common import Log, pick_device, seed_all, write_json
from training.configs import PRESETS, DraftSettings, Preset, StageSettings, dflash_config, target_config
from training.distill import make_distill_set, mtp_agreement, train_mtp
from training.export import export_drafter, export_target, tar_folder, untar_safely
from training.train_dflash import build_drafter, drafter_state, train_dflash, window_acceptance
from training.train_target import build_target, held_out_nll, train_target

TARGET, DRAFT, TURBO = "strata-nano", "strata-nano-dflash2", "strata-nano-dflash2-turbo"


class Deadline:
    """Fits each stage's seconds into what is left of the wall-time budget (keeping reserves for later stages)."""

    def __init__(self, seconds: float) -> None:
        self.t0, self.seconds = time.time(), seconds

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)

    def fit(self, s: StageSettings, reserve: float) -> StageSettings:
        import dataclasses

        return dataclasses.replace(s, seconds=max(5.0, min(s.seconds, self.left() - reserve)))


def run(preset: Preset, data_dir: Path, out: Path, work: Path, device: torch.device, *, resume: Path | None,
        deadline_s: float, seed: int = 1234, quiet: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out / "log.jsonl", quiet=quiet)
    clock = Deadline(deadline_s)
    seed_all(seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    g = preset.geometry
    data = corpus.load(data_dir)
    tok_json = data_dir / "tokenizer.json"
    manifest = json.loads((data_dir / "manifest.json").read_text()) if (data_dir / "manifest.json").is_file() else {}
    metrics: dict = {"preset": preset.name, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu", "torch": torch.__version__, "seed": seed, "corpus": {
                         k: manifest.get(k) for k in ("python", "files", "file_list_sha256", "train_tokens",
                                                      "eval_tokens", "tokenizer_sha256")}, "stages": {}}

    def save_metrics() -> None:
        write_json(out / "metrics.json", metrics)

    def ship_target(model) -> None:
        export_target(model, work / TARGET, target_config(g), tok_json)
        tar_folder(work / TARGET, out / f"{TARGET}.tar")

    # --- stage 1: target + MTP ------------------------------------------------------------------------------
    resumed = resume / f"{TARGET}.tar" if resume else None
    if resumed is not None and resumed.is_file():
        untar_safely(resumed, work)
        model = load_target(work / TARGET, device="cpu", dtype=torch.float32).to(device)
        tar_folder(work / TARGET, out / f"{TARGET}.tar")
        metrics["stages"]["target"] = {"resumed_from": str(resumed)}
        log(stage="target", resumed=str(resumed))
    else:
        model = build_target(g, seed)
        reserve = preset.mtp.seconds + preset.dflash.seconds + preset.turbo.seconds + 60
        st = train_target(model, data["train"], clock.fit(preset.target, reserve), device, log, seed=seed,
                          eval_tokens=data["eval"], eval_every=400, checkpoint=ship_target, checkpoint_every_s=90)
        metrics["stages"]["target"] = st
        ship_target(model)
    model.to(device).eval()
    t0 = time.time()
    metrics["held_out"] = held_out_nll(model, data["eval"], preset.target.seq, device, preset.eval_tokens)
    metrics["stages"]["held_out_eval"] = {"seconds": round(time.time() - t0, 1)}
    log(stage="held_out", **metrics["held_out"])
    save_metrics()

    # --- stage 2: distillation set (train prompts) and a held-out one for measuring acceptance ----------------
    t0 = time.time()
    seqs = make_distill_set(model, data["train"], preset.distill_prompts, preset.distill_prompt_len,
                            preset.distill_new, device, log, seed=seed + 1,
                            seconds=max(10.0, min(60.0, clock.left() - 200)))
    eval_seqs = make_distill_set(model, data["eval"], max(8, preset.distill_prompts // 24),
                                 preset.distill_prompt_len, preset.distill_new, device, log, seed=seed + 2)
    metrics["stages"]["distill"] = {"seconds": round(time.time() - t0, 1), "sequences": int(seqs.shape[0]),
                                    "tokens": int(seqs.numel()), "eval_sequences": int(eval_seqs.shape[0])}
    save_metrics()

    # --- stage 3: MTP fine-tune on the continuations ----------------------------------------------------------
    if not (resumed is not None and resumed.is_file()):
        try:
            reserve = preset.dflash.seconds + preset.turbo.seconds + 30
            metrics["stages"]["mtp"] = train_mtp(model, seqs, preset.distill_prompt_len,
                                                 clock.fit(preset.mtp, reserve), device, log, seed=seed + 3)
            ship_target(model)
        except Exception:  # keep the stage-1 target; report the failure
            metrics["stages"]["mtp"] = {"error": traceback.format_exc(limit=3)}
    metrics["held_out_mtp"] = mtp_agreement(model, eval_seqs, preset.distill_prompt_len, device)
    log(stage="mtp", held_out=metrics["held_out_mtp"])
    save_metrics()

    # --- stages 4 and 5: DFlash2 heads -------------------------------------------------------------------------
    heads: list[tuple[str, DraftSettings, float]] = [(DRAFT, preset.dflash, preset.turbo.seconds + 15),
                                                      (TURBO, preset.turbo, 10)]
    for i, (name, s, reserve) in enumerate(heads):
        if resume is not None and (resume / f"{name}.tar").is_file():
            (out / f"{name}.tar").write_bytes((resume / f"{name}.tar").read_bytes())
            metrics["stages"][name] = {"resumed_from": str(resume / f"{name}.tar")}
            continue
        try:
            cfg = dflash_config(g, s.block)
            drafter = build_drafter(cfg, seed + 10 + i)

            def ship(d, name=name, cfg=cfg) -> None:
                export_drafter(drafter_state(d), work / name, cfg)
                tar_folder(work / name, out / f"{name}.tar")

            st = train_dflash(drafter, model, seqs, preset.distill_prompt_len, clock.fit(s, reserve), device, log,
                              seed=seed + 20 + i, stage=name, checkpoint=ship)
            ship(drafter)
            st["acceptance"] = [window_acceptance(drafter, model, eval_seqs, preset.distill_prompt_len, w, device)
                                for w in sorted({8, s.block})]
            metrics["stages"][name] = st
            log(stage=name, acceptance=st["acceptance"])
        except Exception:
            metrics["stages"][name] = {"error": traceback.format_exc(limit=5)}
            log(stage=name, error=metrics["stages"][name]["error"])
        save_metrics()

    metrics["total_s"] = round(time.time() - clock.t0, 1)
    save_metrics()
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the strata-nano pack (target + MTP, two DFlash2 heads).")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="nano")
    ap.add_argument("--data", type=Path, default=Path("training/data"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("training/runs/work"))
    ap.add_argument("--resume", type=Path, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--deadline-s", type=float, default=570.0)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    if not (args.data / "corpus.npz").is_file():
        print(f"{args.data} has no corpus.npz; build it first with `python -m training.corpus --out {args.data}`.")
        return 2
    if args.preset == "toy":  # seconds-long CPU runs: threads only contend
        torch.set_num_threads(1)
    np.set_printoptions(precision=4)
    m = run(PRESETS[args.preset], args.data, args.out, args.work, pick_device(args.device), resume=args.resume,
            deadline_s=args.deadline_s, seed=args.seed)
    print(json.dumps({"total_s": m["total_s"], "held_out": m["held_out"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
