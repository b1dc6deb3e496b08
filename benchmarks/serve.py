"""Streaming through picompile's OpenAI-compatible server against the engine's own generate().

    .venv/bin/python benchmarks/serve.py                 # SmolLM2-135M-Instruct, threshold @50%
    .venv/bin/python benchmarks/serve.py --new-tokens 64 --repeats 15 --sparsity 0.5

Issue 11's target: streaming time-to-first-token and tokens/s through the server within 10% of
the engine's own. The script loads and compiles the default model as `picompile run` does
(exact mode, threshold sparsity 0.5 by default), then for two prompts, one per endpoint:

  engine  cm.generate(ids, greedy, the server's EOS / pad ids) with a streamer that notes when
          each token arrives. TTFT: from the call to the first new token (prefill + first pick,
          the prompt tokenized beforehand). Decode tokens/s: (n - 1) / (generate() returned -
          first token).
  server  uvicorn in a thread on a free 127.0.0.1 port (as picompile.serve() starts it), the
          official `openai` client in this process, stream=True, temperature 0,
          stream_options={"include_usage": true}. TTFT: from the create() call to the first
          chunk with text (the chat endpoint's first, role-only chunk does not count).
          Decode tokens/s: (n - 1) / (the finish_reason chunk - the first text chunk), n from
          the usage chunk. So the server's figures include HTTP, JSON, tokenizing the prompt
          (and the chat template), the hand-off to the worker thread, detokenizing each token
          and the client's parsing: everything a client pays for.

Both paths generate the same prompt ids (checked against the usage chunk) and the same number
of tokens (checked: the prompts are chosen so greedy decoding does not reach EOS within
--new-tokens; the script stops if it does) and the same text (checked). Runs alternate engine
and server (the order swapped every other repeat) to spread the shared VM's drift over both;
the table gives medians over --repeats and the ratio server / engine (TTFT: >1 is slower;
tokens/s: <1 is slower), and in brackets the median of each repeat's own ratio (its two runs
were taken next to each other, so slow drift cancels). The CPU share other processes used during
the measurements is printed: on a 2-core VM another busy process moves these figures. Last, the
CPU each thread used per generated token (the generating thread on either path, the server's
event loop, the client; from the threads' own clocks) and an empty round trip, to show where
any difference comes from. About 3.5 minutes on a 2-core VM, 70 s of it compiling.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import picompile  # noqa: E402
from picompile import models  # noqa: E402
from picompile.serve import Engine, make_app  # noqa: E402

from machine import OtherLoad, cpu_name  # noqa: E402  (benchmarks/machine.py, beside this script)

COMPLETION_PROMPT = "Once upon a time, in a small village at the edge of a great forest,"
CHAT_PROMPT = ("Write a long, detailed essay on the history of the Roman Empire, from its "
               "founding to its fall.")


class Clock:
    """A generate() streamer noting when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds `thread` has used (its own clock: nanoseconds, not the 10 ms ticks of
    /proc), so a run's per-token costs on each thread can be told apart."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def engine_once(cm, ids: list[int], n: int, eos: list[int], pad) -> dict:
    x = torch.tensor([ids])
    clock = Clock()
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    out = cm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      eos_token_id=eos or None, pad_token_id=pad, streamer=clock)
    end = time.perf_counter()
    cpu = time.thread_time() - cpu0
    new = out[0, len(ids):].tolist()
    return {"ttft": clock.times[0] - t0, "tps": (len(new) - 1) / (end - clock.times[0]),
            "tokens": len(new), "ids": new, "cpu_gen": cpu}


def server_once(client, endpoint: str, prompt: str, n: int, loop_thread: threading.Thread,
                worker: threading.Thread) -> dict:
    kw = dict(model="picompile", max_tokens=n, temperature=0, stream=True,
              stream_options={"include_usage": True})
    cpu0 = time.thread_time(), thread_cpu(loop_thread), thread_cpu(worker)
    t0 = time.perf_counter()
    if endpoint == "chat":
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = client.completions.create(prompt=prompt, **kw)
    first = finish = None
    usage = None
    parts = []
    chunks = 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text = choice.delta.content if endpoint == "chat" else choice.text
        if text:
            chunks += 1
            parts.append(text)
            if first is None:
                first = now
        if choice.finish_reason is not None:
            finish = now
    client_cpu, loop_cpu, gen_cpu = (b - a for a, b in zip(
        cpu0, (time.thread_time(), thread_cpu(loop_thread), thread_cpu(worker))))
    if first is None or finish is None or usage is None:
        raise RuntimeError(f"{endpoint}: the stream had no text, no finish_reason or no usage")
    n_out = usage.completion_tokens
    return {"ttft": first - t0, "tps": (n_out - 1) / (finish - first), "tokens": n_out,
            "prompt_tokens": usage.prompt_tokens, "text": "".join(parts), "chunks": chunks,
            "cpu_client": client_cpu, "cpu_loop": loop_cpu, "cpu_gen": gen_cpu}


class Running:
    """The app served by uvicorn in a thread on a free 127.0.0.1 port, started as
    picompile.serve() starts it (uvicorn binds host and port itself). Not with a socket made by
    socket.socket() and handed over, as tests/test_serve.py does: such a socket has protocol 0,
    so asyncio does not set TCP_NODELAY on its connections, and every response whose body
    follows its headers in a second small write waits for the client's delayed ACK (about 40 ms
    on Linux), which the real server does not."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as probe:  # a free port (another process could take it meanwhile)
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--mode", choices=["exact", "predicted"], default="exact")
    ap.add_argument("--sparsity", type=float, default=0.5,
                    help="threshold sparsity as `picompile run` uses by default; 0 for dense")
    ap.add_argument("--calibration-tokens", type=int, default=16384)
    ap.add_argument("--plan", metavar="DIR", help="a saved plan (skips compiling)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import openai

    command = "python benchmarks/serve.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"command: {command.strip()}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}, openai {openai.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(os.path.abspath(__file__))
                                ).stdout.strip()
        print(f"commit: {commit or 'unknown (not a git checkout)'}")
    except OSError:
        pass

    t0 = time.perf_counter()
    model, tok = models.load(None)
    if args.plan:
        cm = picompile.load(model, args.plan)
    else:
        cm = picompile.compile(model, mode=args.mode, sparsity=args.sparsity or None,
                               tokenizer=tok, calibration_tokens=args.calibration_tokens,
                               quiet=True)
    print(f"compiled in {time.perf_counter() - t0:.0f} s ({args.mode}, sparsity "
          f"{args.sparsity}); decode step: "
          + ("whole-step decoder" if cm.decoder() is not None else
             f"per module ({cm.decoder_reason})"))

    # the server's own EOS / pad choice and prompt ids, so both paths run the same generate()
    ref = Engine(cm, tok)
    eos, pad = sorted(ref.eos), ref.pad
    text = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}],
                                   add_generation_prompt=True, tokenize=False)
    cases = {"completions": (COMPLETION_PROMPT, list(tok(COMPLETION_PROMPT)["input_ids"])),
             "chat": (CHAT_PROMPT, list(tok(text, add_special_tokens=False)["input_ids"]))}
    n = args.new_tokens

    results = {(c, p): [] for c in cases for p in ("engine", "server")}
    app = make_app(cm, tok, max_tokens=n)
    running = Running(app)
    with running as base_url:
        worker = next(t for t in threading.enumerate() if t.name == "picompile-serve-worker")
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)

        def server(case, prompt):
            return server_once(client, case, prompt, n, running.thread, worker)

        for case, (prompt, ids) in cases.items():  # warm-up, and the checks
            e = engine_once(cm, ids, n, eos, pad)
            s = server(case, prompt)
            if e["tokens"] != n or s["tokens"] != n:
                raise SystemExit(f"{case}: {e['tokens']} tokens from the engine, {s['tokens']} "
                                 f"from the server, not {n}: greedy decoding reached EOS; pick a "
                                 "longer-running prompt or fewer --new-tokens")
            if s["prompt_tokens"] != len(ids):
                raise SystemExit(f"{case}: the server's prompt has {s['prompt_tokens']} tokens, "
                                 f"the engine's {len(ids)}")
            same = tok.decode(e["ids"], skip_special_tokens=True) == s["text"]
            print(f"{case}: prompt {len(ids)} tokens, {n} new tokens on both paths, text "
                  + ("identical" if same else "DIFFERENT") + f", {s['chunks']} text chunks")
        load = OtherLoad()
        t_meas = time.perf_counter()
        for r in range(args.repeats):
            for case, (prompt, ids) in cases.items():
                order = ("engine", "server") if r % 2 == 0 else ("server", "engine")
                for path in order:
                    row = (engine_once(cm, ids, n, eos, pad) if path == "engine"
                           else server(case, prompt))
                    if row["tokens"] != n:
                        raise SystemExit(f"{case} {path}: {row['tokens']} tokens, not {n}")
                    results[case, path].append(row)
        t_meas = time.perf_counter() - t_meas
        other = load.fraction()
        # a request that generates nothing: HTTP, routing and JSON both ways
        roundtrip = []
        for _ in range(20):
            t = time.perf_counter()
            client.models.list()
            roundtrip.append(time.perf_counter() - t)
        client.close()

    print(f"\nSmolLM2-135M-Instruct, {n} new tokens, greedy, median of {args.repeats} "
          f"(alternating engine / server); measured in {t_meas:.0f} s; other processes' CPU "
          "share meanwhile: " + ("unknown" if other is None else f"{other:.0%}"))
    print("\"paired\": the median over repeats of server / engine for the two runs of a repeat, "
          "taken next to each other")
    print()
    print("| endpoint | path | TTFT ms | decode tok/s | TTFT server / engine (paired) | "
          "tok/s server / engine (paired) |")
    print("|---|---|---:|---:|---:|---:|")
    for case in cases:
        eng, srv = results[case, "engine"], results[case, "server"]
        e_ttft, e_tps = median(eng, "ttft"), median(eng, "tps")
        s_ttft, s_tps = median(srv, "ttft"), median(srv, "tps")
        p_ttft = statistics.median(s["ttft"] / e["ttft"] for e, s in zip(eng, srv))
        p_tps = statistics.median(s["tps"] / e["tps"] for e, s in zip(eng, srv))
        print(f"| /v1/{'chat/' if case == 'chat' else ''}completions | engine (cm.generate) | "
              f"{e_ttft * 1e3:.1f} | {e_tps:.2f} | | |")
        print(f"| | server (openai client, stream) | {s_ttft * 1e3:.1f} | {s_tps:.2f} | "
              f"{s_ttft / e_ttft:.3f} ({p_ttft:.3f}) | {s_tps / e_tps:.3f} ({p_tps:.3f}) |")

    print("\nall runs (TTFT ms / tok/s):")
    for (case, path), rows in results.items():
        print(f"  {case:12s} {path:7s} " + "  ".join(f"{r['ttft'] * 1e3:6.1f}/{r['tps']:6.2f}"
                                                    for r in rows))

    print("\nwhere the server's extra time could go (CPU per generated token, median over runs):")
    for case in cases:
        eng, srv = results[case, "engine"], results[case, "server"]
        us = lambda rows, key: median(rows, key) / n * 1e6  # noqa: E731
        print(f"  {case}: generating thread {us(eng, 'cpu_gen'):.0f} us (engine) vs "
              f"{us(srv, 'cpu_gen'):.0f} us (server's worker); server event loop "
              f"{us(srv, 'cpu_loop'):.0f} us; openai client {us(srv, 'cpu_client'):.0f} us")
    print(f"  an empty round trip (GET /v1/models through the client): median "
          f"{statistics.median(roundtrip) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
