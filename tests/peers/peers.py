"""The PyTorch peers (eager, torch.compile, Liger; quack's RMSNorm when importable) for RMSNorm and
LayerNorm forward and backward, bf16, timed the way normkern's bench times itself.

Derived from `../shared/peers/peers.py`, whose `triton.testing.do_bench` times a call between
events recorded on an idle stream (after its L2-flush kernel): when the call's host time (Python,
guards, autograd) outlasts the flush, the host time is counted as device time. normkern's bench
enqueues each call behind a spin kernel so its events time device work alone; `queued` below does
the same (`torch.cuda._sleep` for SPIN_US, longer than the peers' host time, which it reports, so
a spin too short shows: that direction's `*_gbs` is then null and `*_host_bound` true, and the
plot leaves the point out). Both timings are kept: `fwd_us`/`bwd_us` (queued, what the sweep
plot compares with) and `fwd_us_do_bench`/`bwd_us_do_bench` (the reference script's). On the
lent H200 the peers' backward took 300–900 µs of host time per call: SPIN_US=1500 covers it.

Run on the GPU machine: `SHAPES=65536x1024,... IMPLS=eager,compile,liger OUT=dir python3 peers.py`.
Prints one line per (impl, op, shape); writes `$OUT/peers.json` after every row (the format
`cargo xtask plot-sweep --peers` reads). Bytes: x + y forward, x + dy + dx backward.
"""
import json, os, statistics, time
import torch, torch.nn.functional as F
from triton.testing import do_bench

torch.manual_seed(0)
dev, bf16, eps = "cuda", torch.bfloat16, 1e-6
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "65536x1024,16384x4096,8192x8192,4096x16384,1024x65536").split(",")]
IMPLS = os.environ.get("IMPLS", "eager,compile,liger,quack").split(",")
SPIN_US = float(os.environ.get("SPIN_US", "1500"))
REPS, WARMUP = 100, 20
res = []


def spin_cycles():
    """Cycles of `torch.cuda._sleep` that take SPIN_US on this GPU (measured, not assumed)."""
    cycles = 1 << 20
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)
    a.record(); torch.cuda._sleep(cycles); b.record(); torch.cuda.synchronize()
    return int(cycles * SPIN_US / (a.elapsed_time(b) * 1e3))


CYCLES = spin_cycles()


def queued(fn):
    """Median device time (ms) of fn, each call enqueued behind a spin; and the median host time
    (µs) of enqueueing it, which must stay below SPIN_US for the first to be device time alone."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    host = []
    for a, b in ev:
        torch.cuda._sleep(CYCLES)
        t0 = time.perf_counter()
        a.record(); fn(); b.record()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev), statistics.median(host)


def dobench(fn):
    return do_bench(fn, warmup=50, rep=300, return_mode="median")  # ms


src = torch.empty(1 << 30, device=dev, dtype=bf16); dst = torch.empty_like(src)
copy_ms, _ = queued(lambda: dst.copy_(src))
copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
del src, dst
print(f"copy {copy_gbs:.0f} GB/s (read+write, queued); spin {SPIN_US:.0f} us = {CYCLES} cycles", flush=True)
res.append(dict(impl="copy", op="copy", gbs=copy_gbs))


def makers(impl, op, N):
    if impl in ("eager", "compile"):
        f = (lambda x, w, b: F.rms_norm(x, (N,), w, eps)) if op == "rms" else (lambda x, w, b: F.layer_norm(x, (N,), w, b, eps))
        if impl == "compile":
            # A fresh compile per (op, shape): dynamo's recompile limit (8) would otherwise send
            # the sweep's later shapes to eager, silently.
            torch._dynamo.reset()
            return torch.compile(f, dynamic=False)
        return f
    if impl == "liger":
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        return (lambda x, w, b: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)) if op == "rms" else (lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps))
    if impl == "quack":
        import importlib
        q = importlib.import_module("quack.rmsnorm")
        return (lambda x, w, b: q.rmsnorm(x, w, eps=eps)) if op == "rms" else None
    raise ValueError(impl)


for (M, N) in SHAPES:
    for op in ["rms", "ln"]:
        for impl in IMPLS:
            try:
                f = makers(impl, op, N)
                if f is None:
                    continue
                x = torch.randn(M, N, device=dev, dtype=bf16, requires_grad=True)
                w = (1 + 0.1 * torch.randn(N, device=dev)).to(bf16).requires_grad_()
                b = (0.1 * torch.randn(N, device=dev)).to(bf16).requires_grad_()
                dy = torch.randn(M, N, device=dev, dtype=bf16)
                params = [x, w] if op == "rms" else [x, w, b]
                y = f(x, w, b)
                fwd_call = lambda: f(x, w, b)
                bwd_call = lambda: torch.autograd.grad(y, params, dy, retain_graph=True)
                (fwd, fwd_host), (bwd, bwd_host) = queued(fwd_call), queued(bwd_call)
                fwd_db, bwd_db = dobench(fwd_call), dobench(bwd_call)
                fb, bb = 2 * M * N * 2, 3 * M * N * 2
                r = dict(impl=impl, op=op, rows=M, d=N, fwd_us=fwd * 1e3, bwd_us=bwd * 1e3,
                         fwd_gbs=fb / fwd / 1e6, bwd_gbs=bb / bwd / 1e6,
                         fwd_host_us=fwd_host, bwd_host_us=bwd_host,
                         fwd_us_do_bench=fwd_db * 1e3, bwd_us_do_bench=bwd_db * 1e3)
                for direction, host in (("fwd", fwd_host), ("bwd", bwd_host)):
                    if host >= SPIN_US:
                        # Device time unknown: the call was still being enqueued after the spin.
                        r[f"{direction}_gbs"], r[f"{direction}_host_bound"] = None, True
                res.append(r)
                if os.environ.get("OUT"):
                    json.dump(res, open(os.path.join(os.environ["OUT"], "peers.json"), "w"), indent=1)
                short = " SPIN TOO SHORT" if max(fwd_host, bwd_host) >= SPIN_US else ""
                print(f"{impl:8s} {op:3s} {M:7d}x{N:<6d} fwd {r['fwd_us']:7.1f} us ({fb/fwd/1e6/copy_gbs:4.0%}) "
                      f"bwd {r['bwd_us']:7.1f} us ({bb/bwd/1e6/copy_gbs:4.0%}) | do_bench fwd {fwd_db*1e3:7.1f} "
                      f"bwd {bwd_db*1e3:7.1f} us | host {fwd_host:5.0f} / {bwd_host:5.0f} us{short}", flush=True)
                del x, w, b, dy, y
            except Exception as e:
                print(f"{impl:8s} {op:3s} {M}x{N} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
            torch.cuda.empty_cache()
if os.environ.get("OUT"):
    json.dump(res, open(os.path.join(os.environ["OUT"], "peers.json"), "w"), indent=1)
