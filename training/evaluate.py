"""Measure the bundled pack on the held-out modules through the runtime engine (CPU is enough; greedy).

    python -m training.evaluate [--bundled setup_wizard/bundled] [--prompts 16] [--max-new 128] [--json OUT]

Reports the target's held-out perplexity, then for each drafter (MTP at chain 3 = block 4, DFlash2 BF16 at
block 8, its Q4_0 conversion at block 8, the turbo head at blocks 8 and 16) the mean tokens per verify window
(accepted + bonus: (accepted + windows) / windows over all prompts), and checks every speculative output equals
the target-only greedy output token for token. Prompts: the text of held-out stdlib modules (never trained on)
cut after a `def` line near one third and two thirds of each file, last `--prompt-tokens` tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from training.corpus import collect

BUNDLED = Path(__file__).resolve().parent.parent / "setup_wizard" / "bundled"
TARGET, DRAFT, TURBO = "strata-nano", "strata-nano-dflash2", "strata-nano-dflash2-turbo"


def held_out_sources() -> list[tuple[str, str]]:
    """The held-out module files (tests excluded) of this interpreter's standard library, sorted by path."""
    return [(rel, text) for rel, text in collect().eval_files if not rel.startswith("test/")]


def make_prompts(tokenizer, files: list[tuple[str, str]], n: int, prompt_tokens: int) -> list[list[int]]:
    """Up to `n` prompts: each file cut after the `def` line nearest 1/3 and 2/3 of its length."""
    prompts = []
    for _, text in files:
        starts = [i for i in range(len(text)) if text.startswith("def ", i) and (i == 0 or text[i - 1] in " \n")]
        cuts = set()
        for frac in (1 / 3, 2 / 3):
            if not starts:
                break
            i = min(starts, key=lambda s: abs(s - frac * len(text)))
            end = text.find("\n", i)
            if end > 0:
                cuts.add(end + 1)
        for c in sorted(cuts):
            ids = tokenizer.encode(text[:c]).ids[-prompt_tokens:]
            if len(ids) >= 16:
                prompts.append(ids)
    return prompts[:n]


def perplexity(target_dir: Path, files: list[tuple[str, str]], tokenizer, max_tokens: int,
               seq: int = 512) -> dict[str, float]:
    """Held-out next-token perplexity of the target (fp32, CPU), documents joined by EOS like the corpus."""
    from runtime.loading import load_target
    from training.tok import EOS
    from training.train_target import held_out_nll

    ids: list[int] = []
    for _, text in files:
        ids += tokenizer.encode(text).ids + [EOS]
        if len(ids) > max_tokens + 1:
            break
    model = load_target(target_dir, device="cpu", dtype=torch.float32)
    res = held_out_nll(model, np.asarray(ids[: max_tokens + 1]), seq, torch.device("cpu"), max_tokens)
    return {"ppl": res["ppl"], "nll": res["nll"], "top1": res["acc"], "tokens": res["tokens"]}


def run_variant(engine, prompts: list[list[int]], max_new: int, block: int | None,
                reference: list[list[int]] | None) -> dict:
    """Greedy generation over all prompts; mean tokens per window and losslessness against `reference`."""
    windows = accepted = proposed = generated = 0
    decode_s = 0.0
    same = True
    outs = []
    for i, p in enumerate(prompts):
        r = engine.generate(p, max_new_tokens=max_new, block=block, draft=block is not None)
        outs.append(r.token_ids)
        st = r.stats
        windows += st["windows"]
        accepted += st["accepted"]
        proposed += st["proposed"]
        generated += st["generated_tokens"]
        decode_s += st["decode_s"]
        if reference is not None and r.token_ids != reference[i]:
            same = False
    return {"block": block or 1, "windows": windows, "accepted": accepted, "proposed": proposed,
            "generated": generated, "tokens_per_window": (accepted + windows) / max(1, windows),
            "decode_tok_s": generated / decode_s if decode_s else 0.0, "equal_to_target": same, "outputs": outs}


def evaluate(bundled: Path, n_prompts: int, max_new: int, prompt_tokens: int, ppl_tokens: int,
             quants: tuple[str, ...] = ("q4_0",), log=print) -> dict:
    from runtime.engine import Engine
    from runtime.loading import load_tokenizer

    t0 = time.time()
    target = bundled / TARGET
    tok = load_tokenizer(target)
    files = held_out_sources()
    prompts = make_prompts(tok, files, n_prompts, prompt_tokens)
    res: dict = {"python": sys.version.split()[0], "prompts": len(prompts), "max_new_tokens": max_new,
                 "prompt_tokens": prompt_tokens, "held_out_files": [r for r, _ in files]}
    res["perplexity"] = perplexity(target, files, tok, ppl_tokens)
    log(f"held-out perplexity {res['perplexity']['ppl']:.2f} over {res['perplexity']['tokens']} tokens")
    variants: dict[str, dict] = {}
    base = Engine.build(target, "none", device="cpu", context=2048)
    variants["target"] = run_variant(base, prompts, max_new, None, None)
    ref = variants["target"]["outputs"]
    res["sample"] = base.tokenizer.decode(prompts[0][-48:]) + "<<<>>>" + base.tokenizer.decode(ref[0])
    del base
    plan = [("mtp", "mtp", None, 4), ("dflash2 bf16", "dflash2", bundled / DRAFT, 8)]
    with tempfile.TemporaryDirectory() as td:
        for q in quants:
            from setup_wizard.convert import convert_dflash2

            out = Path(td) / f"{DRAFT}-{q}.gguf"
            convert_dflash2(bundled / DRAFT, q, out)
            plan.append((f"dflash2 {q}", "dflash2", out, 8))
        plan += [("turbo bf16", "dflash2", bundled / TURBO, 8), ("turbo bf16", "dflash2", bundled / TURBO, 16)]
        for name, kind, path, block in plan:
            eng = Engine.build(target, kind, drafter_path=path, device="cpu", context=2048, block=block)
            v = run_variant(eng, prompts, max_new, block, ref)
            variants[f"{name} @ block {block}"] = v
            log(f"{name:14s} block {block:2d}: {v['tokens_per_window']:.2f} tokens/window "
                f"({v['accepted']}/{v['proposed']} accepted, {v['windows']} windows), "
                f"{v['decode_tok_s']:.1f} tok/s, equal to target: {v['equal_to_target']}")
    for v in variants.values():
        v.pop("outputs", None)
    res["variants"] = variants
    t = variants["target"]
    log(f"{'target only':14s} block  1: {t['decode_tok_s']:.1f} tok/s")
    res["seconds"] = round(time.time() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Held-out quality of the bundled strata-nano pack (CPU, greedy).")
    ap.add_argument("--bundled", type=Path, default=BUNDLED)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--ppl-tokens", type=int, default=32768)
    ap.add_argument("--quant", action="append", default=None, help="converted heads to measure (default q4_0)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (more only help on an idle machine)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    if not (args.bundled / TARGET / "config.json").is_file():
        print(f"{args.bundled} holds no {TARGET} folder; pass --bundled with the pack's folder.", file=sys.stderr)
        return 2
    res = evaluate(args.bundled, args.prompts, args.max_new, args.prompt_tokens, args.ppl_tokens,
                   tuple(args.quant or ("q4_0",)))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    bad = [k for k, v in res["variants"].items() if not v["equal_to_target"]]
    if bad:
        print(f"speculative output differed from the target's for {', '.join(bad)}.", file=sys.stderr)
        return 1
    return 0 if all(math.isfinite(res["perplexity"]["ppl"]) for _ in [0]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
