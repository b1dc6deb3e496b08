"""Bandwidth probes and the GPU sparse kernels' read rate, on a CUDA machine.

    python benchmarks/gpu_kernels.py

1. device copy bandwidth: a 2 GB device-to-device copy, bytes read + written per second
   (the ceiling a memory-bound kernel is held to);
2. host streaming read: torch's sum over a 4 GB float32 tensor on all CPU threads;
3. host <-> device copies through pinned memory (what the hybrid hand-off crosses);
4. the hot-side kernels (codegen.cuda.CudaFFN) on 13B-shaped float16 blocks: OPT (plain ReLU
   with biases, d 5120 x 20480) and ReLU-Llama (gated, 5120 x 13824), for candidate shares from
   5% to 100%, given the rows' mask on the device (the hybrid path): weight bytes they must read
   (a first row per candidate, the others per firing neuron) per second, and the share of the
   copy bandwidth. Two times per call, medians of CUDA-event intervals: "launched", a call as
   the host launches it (at small shares the GPU waits for the launches), and "GPU", calls
   captured back to back in one CUDA graph (as the device decoder replays them), which the
   rates use. COPIES copies of the weights take turns so that no call finds the rows of the
   calls before it in L2;
5. where a call's time goes: its first kernel (the compaction), the first two (+ gate / up) and
   all three (+ down), each in a CUDA graph as above.
"""

from __future__ import annotations

import statistics

import torch

from picompile.codegen.cuda import CudaFFN, torch_stream


def event_median(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, from CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def graph_median(fn, calls: int = 24, reps: int = 10) -> float:
    """Median seconds per fn() on the GPU alone: `calls` of them captured in one CUDA graph (no
    host launch between them), its replays timed by CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up where the graph is captured
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            fn()
    return event_median(graph.replay, reps=reps) / calls


def copy_bandwidth() -> float:
    n = 2 * 10**9 // 2
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.float16)
    dst = torch.empty_like(src)
    s = event_median(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * 2 / s


def host_read_bandwidth() -> float:
    import time

    x = torch.randn(10**9)  # 4 GB float32
    x.sum()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def pinned_copy_bandwidth() -> tuple[float, float]:
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    h2d = event_median(lambda: dev.copy_(host, non_blocking=True), reps=10)
    d2h = event_median(lambda: host.copy_(dev, non_blocking=True), reps=10)
    return host.numel() / h2d, host.numel() / d2h


def block(gated: bool, d: int, n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = lambda *shape: (torch.randn(*shape, generator=g, device="cuda") * 0.02).half()  # noqa: E731
    kw = dict(w_up=w(n, d), w_down_t=w(n, d))
    if gated:
        kw["w_gate"] = w(n, d)
    else:
        kw["b_up"] = w(n)
        kw["b_down"] = w(d)
    return kw


COPIES = 6  # of each block's weights: a 5% call reads ~16 MB, six of them exceed the 50 MB L2


def kernel_rates(gated: bool, d: int, n: int, copy_bw: float) -> list[str]:
    ffns = []
    for seed in range(COPIES):
        kw = block(gated, d, n, seed)
        ffns.append(CudaFFN(kw.pop("w_up"), kw.pop("w_down_t"), **kw))
    x = torch.randn(1, d, device="cuda").half()
    first, later = (1, 2) if gated else (1, 1)
    row = d * 2
    lines = []
    for share in (0.05, 0.1, 0.25, 0.5, 1.0):
        g = torch.Generator(device="cuda").manual_seed(7)
        mask = torch.rand(1, n, generator=g, device="cuda") < share
        turn = [0]

        def call():
            turn[0] = (turn[0] + 1) % COPIES
            return ffns[turn[0]].ffn_given_mask(x, mask)

        launched = event_median(call)
        try:
            s = graph_median(call, calls=4 * COPIES)
        except RuntimeError as e:  # the rates then hold the launches too: said, not hidden
            print(f"no CUDA graph of the calls ({type(e).__name__}: {str(e)[:200]}): the "
                  "'GPU' column is the launched time", flush=True)
            s = launched
        candidates = int(mask.sum())
        # the copies' rows differ, so do their firings: the mean over the copies
        active = statistics.mean(int(f.ffn_given_mask(x, mask)[1]) for f in ffns)
        nbytes = (candidates * first + active * later) * row
        lines.append(f"| {'gated' if gated else 'plain'} {d}x{n} | {share:.0%} | {candidates} | "
                     f"{active:.0f} | {nbytes / 1e6:.1f} | {launched * 1e6:.1f} | {s * 1e6:.1f} | "
                     f"{nbytes / s / 1e9:.0f} | {nbytes / s / copy_bw:.0%} |")
    return lines


def kernel_stages(gated: bool, d: int, n: int) -> list[str]:
    """Microseconds a call in a CUDA graph of its first kernel (compaction), its first two
    (+ gate / up) and all three (+ down: the call), at 5% and 100% of the rows: what each
    kernel adds, launch gaps and tails included."""
    ffns = []
    for seed in range(COPIES):
        kw = block(gated, d, n, seed)
        ffns.append(CudaFFN(kw.pop("w_up"), kw.pop("w_down_t"), **kw))
    f0 = ffns[0]
    x = torch.randn(1, d, device="cuda").half()
    idx = torch.empty(n, dtype=torch.int32, device="cuda")
    count = torch.empty(1, dtype=torch.int32, device="cuda")
    counters = f0._counters()
    h = torch.empty(1, n, dtype=torch.float32, device="cuda")
    out = torch.empty(1, d, dtype=torch.float32, device="cuda")
    lines = []
    for share in (0.05, 1.0):
        g = torch.Generator(device="cuda").manual_seed(7)
        mask = torch.rand(1, n, generator=g, device="cuda") < share
        turn = [0]
        stages = [
            lambda f: f.kernels.compact_mask(mask, idx, count, counters),
            lambda f: f.kernels.gate_up(x, f.w_gate, f.w_up, f.b_gate, f.b_up, idx, count, n,
                                        f.threshold, h, counters[0]),
            lambda f: f.kernels.down(h, n, idx, count, f.w_down_t, f.b_down, out, False,
                                     counters[1:]),
        ]
        times = []
        for upto in (1, 2, 3):
            def call(upto=upto):
                turn[0] = (turn[0] + 1) % COPIES
                with torch_stream(f0.device):
                    for stage in stages[:upto]:
                        stage(ffns[turn[0]])
            times.append(graph_median(call, calls=4 * COPIES) * 1e6)
        lines.append(f"| {'gated' if gated else 'plain'} {d}x{n} | {share:.0%} | {times[0]:.1f} | "
                     f"{times[1]:.1f} | {times[2]:.1f} |")
    return lines


def launch_profile(calls: int = 200) -> str:
    """Where the host's time goes in one hot-part call (OPT-13B-shaped block, 5% of rows): the
    kernels take microseconds, so Python and CuPy launch costs show as GPU idle time."""
    import cProfile
    import io
    import pstats
    import time

    kw = block(False, 5120, 20480, 0)
    ffn = CudaFFN(kw.pop("w_up"), kw.pop("w_down_t"), **kw)
    x = torch.randn(1, 5120, device="cuda").half()
    mask = torch.rand(1, 20480, device="cuda") < 0.05
    for _ in range(10):
        ffn.ffn_given_mask(x, mask)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        ffn.ffn_given_mask(x, mask)
    host = (time.perf_counter() - t) / calls
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        ffn.ffn_given_mask(x, mask)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    return f"host time per hot-part call: {host * 1e6:.0f} us\n" + out.getvalue()


def main():
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    copy_bw = copy_bandwidth()
    print(f"device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"host streaming read (torch sum, {torch.get_num_threads()} threads): "
          f"{host_read_bandwidth() / 1e9:.1f} GB/s")
    h2d, d2h = pinned_copy_bandwidth()
    print(f"pinned host -> device {h2d / 1e9:.1f} GB/s, device -> host {d2h / 1e9:.1f} GB/s")
    print()
    print("| block | candidate share | candidates | fired | MB read | us launched | us GPU | GB/s "
          "(GPU) | of copy bw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for line in kernel_rates(False, 5120, 20480, copy_bw) + kernel_rates(True, 5120, 13824, copy_bw):
        print(line, flush=True)
    print()
    print("| block | candidate share | us: compaction | + gate / up | + down (the call) |")
    print("|---|---|---|---|---|")
    for line in kernel_stages(False, 5120, 20480) + kernel_stages(True, 5120, 13824):
        print(line, flush=True)
    print()
    print(launch_profile())


if __name__ == "__main__":
    main()
