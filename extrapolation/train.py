"""Train the byte-level model with ordinary RoPE at a short context.

    python -m extrapolation.train --seed 0                 # the stored model: 2000 steps, ~45 s on an H200
    python -m extrapolation.train --seed 0 --seconds 170   # as many steps as fit in 170 s of training

With ``--seconds`` the run times its first steps and picks the step count that fills the time;
the count it chose is printed and stored (``steps`` in the training record), so
``--steps N --seed S`` repeats that run's learning-rate schedule exactly. On the 10 MB corpus of
Ubuntu's Python 3.12 the held-out loss stops improving after about 1500 steps; longer runs
overfit. Writes to ``--out-dir``:

* ``extrapolation_split.json``          the train / validation split, every file with its size
* ``extrapolation_heldout.safetensors`` the held-out evaluation documents (bytes)
* ``extrapolation_model.safetensors``   the trained weights (bf16) and the model config
* ``extrapolation_training.json``       the loss curve, settings, device and versions
"""

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import data
from .model import ByteLM, ModelConfig, parameter_count, save_weights, token_losses

ROOT = Path(__file__).resolve().parent.parent
HELDOUT_DOCS = 128         # held-out documents (windows of validation files) kept for evaluation
HELDOUT_FACTOR = 16        # ... each 16x the training length (+1 byte for the last target)


def environment():
    """Device and versions of this run, for the results files."""
    import triton
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "cuda": torch.version.cuda,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def learning_rate(step, total, peak, warmup, floor):
    """Linear warm-up over ``warmup`` steps, then cosine from ``peak`` down to ``floor · peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="init, batches and split seed")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (ignored with --seconds)")
    p.add_argument("--seconds", type=float, default=None,
                   help="instead of --steps: train for about this many seconds")
    p.add_argument("--batch", type=int, default=128, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--lr-floor", type=float, default=0.1, help="final lr as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--val-every", type=int, default=500)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--root", type=Path, default=None, help="corpus root (default: this stdlib)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "book" / "data")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = ModelConfig()
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "train_len"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    args = p.parse_args(argv)
    if args.seconds is not None:
        if args.seconds <= 0:
            p.error(f"--seconds must be positive, got {args.seconds}")
        args.steps = None
    elif args.steps <= args.warmup // 10:
        p.error(f"--steps must be larger than a tenth of --warmup ({args.warmup})")
    return args


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, ffn_hidden=args.ffn_hidden,
                      train_len=args.train_len)
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)

    # --- data: split by file, the held-out documents, the byte streams on the device
    root = args.root or data.stdlib_dir()
    files = data.list_sources(root)
    train_files, val_files = data.split_files(files, seed=args.seed, val_fraction=args.val_fraction)
    manifest = data.split_manifest(root, train_files, val_files, args.seed, args.val_fraction)
    manifest["python"] = platform.python_version()
    (out_dir / "extrapolation_split.json").write_text(json.dumps(manifest, indent=0) + "\n")
    docs, names = data.heldout_documents(root, val_files, HELDOUT_FACTOR * cfg.train_len + 1,
                                         HELDOUT_DOCS)
    data.save_heldout(out_dir / "extrapolation_heldout.safetensors", docs, names,
                      {"python": platform.python_version(), "seed": args.seed,
                       "rule": "consecutive non-overlapping windows of the validation files"})
    train_stream = data.read_stream(root, train_files).to(device)
    val_stream = data.read_stream(root, val_files).to(device)
    print(f"corpus {root} (Python {platform.python_version()}): {len(train_files)} train files "
          f"({train_stream.numel() / 1e6:.1f} MB), {len(val_files)} validation files "
          f"({val_stream.numel() / 1e6:.1f} MB); {docs.shape[0]} held-out documents of "
          f"{docs.shape[1]} bytes", flush=True)

    # --- model and optimizer (no weight decay on norms)
    model = ByteLM(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=fused)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    val_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    val_batch = data.random_crops(val_stream, 64, cfg.train_len + 1, val_gen)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    print(f"model: {parameter_count(model) / 1e6:.2f} M parameters, {cfg}", flush=True)

    def validate():
        model.eval()
        with torch.no_grad(), autocast:
            loss = token_losses(model, val_batch).mean().item()
        model.train()
        return loss

    total = args.steps
    curve = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
    running, running_count, timer_start = torch.zeros((), device=device), 0, None
    step = 0
    train_start = time.perf_counter()
    while total is None or step < total:
        if total is None and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            timer_start = time.perf_counter()
        if total is None and step == 40:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - timer_start) / 30
            spent = time.perf_counter() - train_start
            # ~3% of the time goes to validation and logging
            total = max(step + 1, int((args.seconds - spent) / (per_step * 1.03)) + step)
            print(f"timed {per_step * 1e3:.1f} ms/step: training for {total} steps "
                  f"(repeat with --steps {total} --seed {args.seed})", flush=True)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, total or 10 ** 9, args.lr, args.warmup, args.lr_floor)
        batch = data.random_crops(train_stream, args.batch, cfg.train_len + 1, gen)
        with autocast:
            loss = token_losses(model, batch).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.detach()
        running_count += 1
        step += 1
        if step % args.log_every == 0 or step == total:
            train_loss = (running / running_count).item()
            running.zero_()
            running_count = 0
            curve["step"].append(step)
            curve["train_loss"].append(round(train_loss, 5))
            line = (f"step {step:>6}/{total or '?'}  train loss {train_loss:.4f}  "
                    f"lr {opt.param_groups[0]['lr']:.2e}  "
                    f"{step * args.batch * cfg.train_len / (time.perf_counter() - train_start) / 1e6:.2f} M tok/s  "
                    f"{time.perf_counter() - started:6.1f} s")
            if step % args.val_every == 0 or step == total:
                val_loss = validate()
                curve["val_step"].append(step)
                curve["val_loss"].append(round(val_loss, 5))
                line += f"  val loss {val_loss:.4f}"
            print(line, flush=True)
    train_seconds = time.perf_counter() - train_start

    meta = {"seed": args.seed, "steps": total, "train_len": cfg.train_len}
    save_weights(model, out_dir / "extrapolation_model.safetensors", meta)
    record = {"environment": environment(), "config": asdict(cfg),
              "parameters": parameter_count(model),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "steps": total, "tokens_seen": total * args.batch * cfg.train_len,
              "train_seconds": round(train_seconds, 1),
              "data": {k: manifest[k] for k in ("train_files", "val_files", "train_bytes",
                                                "val_bytes", "seed", "val_fraction")},
              "heldout_documents": int(docs.shape[0]), "heldout_bytes": int(docs.shape[1]),
              "command": "python -m extrapolation.train " + " ".join(sys.argv[1:]),
              "curve": curve}
    (out_dir / "extrapolation_training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"done: {total} steps in {train_seconds:.0f} s, final val loss {curve['val_loss'][-1]:.4f}; "
          f"wrote {out_dir}/extrapolation_{{model.safetensors,training.json,split.json,heldout.safetensors}}",
          flush=True)


if __name__ == "__main__":
    main()
