"""The HTTP path's cost: time to first token and decode tok/s through strata-serve vs the engine call strata-run
makes, on the same prompts and engine settings (the ratio is the server's overhead), and requests/s with 8
concurrent clients against the one-at-a-time queue. The bundled nano pack, greedy.

    python bench/serve.py --device cpu --threads 1          # here
    python bench/serve.py --device cuda                     # on a GPU

The server runs as its own process (`strata-serve`, as users run it); the clients are stdlib HTTP streams in this
process, so the client library's parsing is not counted. Results: a table, and bench/results/serve.json (or $OUT).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import NANO, NANO_DFLASH2, ROOT, machine, print_table, task_prompts, write_json  # noqa: E402


def write_config(d: Path, device: str, drafter: str, context: int) -> Path:
    cfg = d / "nano-bench.toml"
    dra = f'kind = "{drafter}"' + (f'\npath = "{NANO_DFLASH2}"' if drafter == "dflash2" else "")
    cfg.write_text(f'schema = 1\n[target]\npath = "{NANO}"\n[drafter]\n{dra}\n[memory]\ncontext = {context}\n'
                   f'[device]\ntype = "{device}"\n')
    return cfg


def direct(engine, prompt: str, tokens: int) -> dict:
    """What strata-run does once the model is loaded: one generate call, text streamed to a callback."""
    t0 = time.perf_counter()
    first: list[float] = []
    res = engine.generate(prompt, max_new_tokens=tokens, on_text=lambda s: first or first.append(time.perf_counter()))
    t1 = time.perf_counter()
    n = len(res.token_ids)
    ttft = (first[0] if first else t1) - t0
    return {"ttft_s": ttft, "total_s": t1 - t0, "tokens": n, "text": res.text,
            "tok_s": (n - 1) / (t1 - t0 - ttft) if n > 1 and t1 - t0 > ttft else float("nan")}


def stream(port: int, prompt: str, tokens: int) -> dict:
    """One streamed /v1/completions request: client-side time to the first text chunk, and to [DONE]."""
    body = json.dumps({"model": "nano", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first, text, stats = None, [], {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        doc = json.loads(line[6:])
        piece = doc["choices"][0]["text"] if doc.get("choices") else ""
        if piece and first is None:
            first = time.perf_counter()
        text.append(piece)
        stats = doc.get("strata") or stats
    t1 = time.perf_counter()
    conn.close()
    n = int(stats.get("generated_tokens", 0))
    ttft = (first or t1) - t0
    return {"ttft_s": ttft, "total_s": t1 - t0, "tokens": n, "text": "".join(text),
            "tok_s": (n - 1) / (t1 - t0 - ttft) if n > 1 and t1 - t0 > ttft else float("nan"),
            "server_decode_tok_s": stats.get("decode_tok_s")}


def plain(port: int, prompt: str, tokens: int) -> float:
    body = json.dumps({"model": "nano", "prompt": prompt, "max_tokens": tokens, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200, data
    return time.perf_counter() - t0


def start_server(cfg: Path, threads: int, max_queue: int) -> tuple[subprocess.Popen, int]:
    code = "import sys; from runtime.serve import main; sys.argv[0] = 'strata-serve'; main()"
    args = [sys.executable, "-c", code, "--config", str(cfg), "--port", "0", "--max-queue", str(max_queue),
            "--model-name", "nano"] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "serving" in line:
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()   # drain its log
            return proc, port
    proc.wait(10)
    raise SystemExit(f"strata-serve did not start (exit {proc.returncode}).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (both sides)")
    ap.add_argument("--drafter", default="mtp", choices=["mtp", "dflash2", "none"])
    ap.add_argument("--tokens", type=int, default=64, help="max tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per prompt and path")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per concurrent client")
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args()

    import torch

    from runtime.engine import Engine

    if a.threads:
        torch.set_num_threads(a.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    prompts = task_prompts()
    with tempfile.TemporaryDirectory() as d:
        cfg = write_config(Path(d), device, a.drafter, a.context)
        proc, port = start_server(cfg, a.threads, max_queue=max(16, a.clients))
        try:
            engine = Engine.from_config(cfg)
            t0 = time.perf_counter()
            cold = subprocess.run([sys.executable, "-c", "import sys; from runtime.cli import main; "
                                   "sys.argv[0] = 'strata-run'; main()", "--config", str(cfg), "--prompt",
                                   prompts["code"], "--max-new-tokens", str(a.tokens), "--json"]
                                  + (["--threads", str(a.threads)] if a.threads else []),
                                  cwd=ROOT, capture_output=True, text=True, env={**os.environ})
            cold_s = time.perf_counter() - t0
            assert cold.returncode == 0, cold.stderr
            for p in prompts.values():                       # warm both paths (CUDA graphs, allocator, caches)
                direct(engine, p, a.tokens)
                stream(port, p, a.tokens)
            rows, per_prompt = [], {}
            for name, p in prompts.items():
                d_runs, s_runs = [], []
                for _ in range(a.repeats):            # interleaved, so a busy machine weighs on both alike
                    d_runs.append(direct(engine, p, a.tokens))
                    s_runs.append(stream(port, p, a.tokens))
                same = all(r["text"] == d_runs[0]["text"] for r in d_runs + s_runs)
                dt = statistics.median(r["ttft_s"] for r in d_runs)
                st = statistics.median(r["ttft_s"] for r in s_runs)
                dv = statistics.median(r["tok_s"] for r in d_runs)
                sv = statistics.median(r["tok_s"] for r in s_runs)
                per_prompt[name] = {"prompt_tokens": len(engine.encode(p)), "tokens": d_runs[0]["tokens"],
                                    "same_output": same, "direct": d_runs, "server": s_runs,
                                    "ttft_ratio": st / dt, "tok_s_ratio": dv / sv}
                rows.append([name, per_prompt[name]["prompt_tokens"], d_runs[0]["tokens"], dt * 1e3, st * 1e3,
                             st / dt, dv, sv, dv / sv, "yes" if same else "NO"])
            print_table(f"strata-serve vs the strata-run engine call ({a.drafter} on {engine.device_name}, greedy, "
                        f"{a.tokens} tokens, median of {a.repeats})",
                        ["prompt", "prompt tok", "gen tok", "TTFT direct ms", "TTFT server ms", "TTFT ratio",
                         "tok/s direct", "tok/s server", "tok/s ratio", "same text"], rows)

            seq = [plain(port, prompts["code"], a.tokens) for _ in range(a.repeats)]
            lat: list[float] = []
            lock = threading.Lock()

            def client() -> None:
                for _ in range(a.requests):
                    s = plain(port, prompts["code"], a.tokens)
                    with lock:
                        lat.append(s)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=client) for _ in range(a.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            seq += [plain(port, prompts["code"], a.tokens) for _ in range(a.repeats)]   # before and after
            n = a.clients * a.requests
            rps, seq_rps = n / wall, 1 / statistics.median(seq)
            lat.sort()
            conc = {"clients": a.clients, "requests": n, "wall_s": wall, "requests_per_s": rps,
                    "sequential_requests_per_s": seq_rps, "latency_p50_s": lat[len(lat) // 2],
                    "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))], "tokens_per_request": a.tokens}
            print_table(f"{a.clients} concurrent clients, {a.requests} requests each (code prompt, {a.tokens} tokens)",
                        ["requests/s", "one client req/s", "ratio", "p50 latency s", "p95 latency s"],
                        [[rps, seq_rps, rps / seq_rps, conc["latency_p50_s"], conc["latency_p95_s"]]])
            print(f"strata-run as a command (load + generate, code prompt): {cold_s:.2f} s; through the running "
                  f"server: {statistics.median(seq):.3f} s.")
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            if load is not None:
                print(f"load average (1 min) at the end: {load:.2f} on {os.cpu_count()} CPUs; a busy machine "
                      f"makes every figure noisy.")
        finally:
            proc.terminate()
            proc.wait(30)
    path = write_json("serve.json", {
        "machine": machine(), "load_average_1m": load, "device": device, "drafter": a.drafter, "threads": a.threads, "tokens": a.tokens,
        "repeats": a.repeats, "prompts": per_prompt, "concurrent": conc,
        "strata_run_command_s": cold_s, "server_request_s": statistics.median(seq)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
