#!/usr/bin/env python3
"""Instructions and system calls per message, which CPU speed and the other
core's load cannot blur.

Each case (binding x sender threads) runs `dxnet-bench` twice with uni
throughput of one size, with N and 2N messages, under
`valgrind --tool=callgrind` (user-space instructions of every thread of both
node processes) and under `perf stat -e raw_syscalls:sys_enter` (system calls
of both, natively, with 20 times the messages). The difference of the two runs divided by N is the cost
of one message: start-up, connecting and shutting down cancel out.

callgrind runs the threads of a process one at a time, so an idle thread
that busy-polls while the thread it waits for cannot run is counted too: the
split's `idle` row shows what idling costs per message (natively less, as the
threads run in parallel). Kernel instructions are not counted by callgrind;
the system calls per message stand for them.

Usage: scripts/instructions.py [--bindings dxnet-tcp,raw-tcp-batched]
       [--threads 1,16] [--size 64] [--count 100000] [--out DIR]
Prints a Markdown report (also written to DIR/instructions.md).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Where an instruction is spent, by the source file its code comes from
# (inlined code keeps its own file) or, for library code inlined into the
# project's functions, by the function's module. First match wins.
CATEGORIES = [
    ("bench harness", r"dxnet-bench/|dxnet_bench::"),
    ("ring (ORB)", r"primitives/orb/|primitives::orb"),
    ("write interest", r"primitives/write_interest|write_interest::"),
    ("flow control", r"core/flow\.rs|primitives/credit|core::flow|credit::"),
    ("idle (park, wait)", r"primitives/park|primitives/wait_queue|primitives/sync|park::|wait_queue::"),
    ("send thread (transport)", r"transport/tcp/send|transport/driver|transport/tls|tcp::send|transport::driver"),
    ("receive (transport, pool)", r"transport/tcp/recv|transport/tcp/lease|transport/tcp/mod|core/receive|core/incoming|core/inline|primitives/pool|primitives/read_lease|tcp::recv|core::receive|core::incoming|core::inline|pool::"),
    ("decode (header, serde)", r"dxnet-proto/|dxnet_proto::|postcard|serde"),
    ("dispatch (handlers)", r"core/handlers|core/mod\.rs|core::handlers|run_receiver|register_raw|register_message|Core::register"),
    ("send path (API to ring)", r"core/send|core/connection|core/metrics|primitives/hazard|primitives/cpu|dxnet/src/node|core::send|core::connection|core::metrics|hazard::|sched_getcpu"),
    ("allocator", r"malloc|_int_free|cfree|_int_malloc|realloc|__libc_free|tcache"),
    ("memcpy", r"memmove|memcpy|memset"),
    ("other dxnet", r"dxnet/src/|dxnet::"),
]


def categorize(file: str, func: str) -> str:
    project = file.startswith(("dxnet", "/work")) and "/rustc/" not in file
    for key in ([file, func] if project else [func, file]):
        for name, pat in CATEGORIES:
            if re.search(pat, key):
                return name
    return "std, libc, kernel entry"


def parse_callgrind(path: str) -> tuple[int, str, dict]:
    """(total instructions, command line, per-category instructions)."""
    cmd = ""
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("cmd:"):
                cmd = line[4:].strip()
                break
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no", path],
        capture_output=True, text=True, check=True,
    ).stdout
    total = 0
    split = defaultdict(int)
    line_re = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(.*)$")
    for line in out.splitlines():
        m = line_re.match(line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        rest = m.group(2)
        if "PROGRAM TOTALS" in rest:
            total = n
            continue
        rest = re.sub(r"\s*\[[^\]]*\]\s*$", "", rest)
        file, _, func = rest.partition(":")
        split[categorize(file, func)] += n
    return total, cmd, split


def bench_cmd(exe, binding, threads, size, count, out):
    return [
        exe, "--bindings", binding, "--operations", "throughput", "--modes", "uni",
        "--sizes", str(size), "--threads", str(threads), "--count", str(count),
        "--warmup", "0", "--repetitions", "1", "-o", out,
    ]


def run_callgrind(exe, binding, threads, size, count, work):
    d = tempfile.mkdtemp(dir=work)
    subprocess.run(
        ["valgrind", "--tool=callgrind", "--trace-children=yes",
         f"--callgrind-out-file={d}/cg.%p"]
        + bench_cmd(exe, binding, threads, size, count, os.path.join(d, "res")),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
    )
    nodes = {}
    for f in os.listdir(d):
        if not f.startswith("cg."):
            continue
        total, cmd, split = parse_callgrind(os.path.join(d, f))
        m = re.search(r" node .*--ids (\d+)", cmd)
        if m:
            nodes[int(m.group(1))] = (total, split)
    if len(nodes) != 2:
        sys.exit(f"{binding}: expected 2 node processes under callgrind, found {len(nodes)}")
    return nodes


def run_syscalls(exe, binding, threads, size, count, work):
    d = tempfile.mkdtemp(dir=work)
    r = subprocess.run(
        ["perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter", "--"]
        + bench_cmd(exe, binding, threads, size, count, os.path.join(d, "res")),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    for line in r.stderr.splitlines():
        if "raw_syscalls:sys_enter" in line:
            v = line.split(",")[0]
            if v.isdigit():
                return int(v)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bindings", default="dxnet-tcp,dxnet-tcp-typed,raw-tcp-batched")
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--out", default="bench-results/instructions")
    ap.add_argument("--exe", default=os.path.join(ROOT, "target/release/dxnet-bench"))
    a = ap.parse_args()
    for tool in ["valgrind", "callgrind_annotate"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (apt-get install valgrind)")
    have_perf = shutil.which("perf") is not None
    if not os.path.exists(a.exe):
        sys.exit(f"{a.exe} missing: cargo build --release -p dxnet-bench")
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dxnet-instr-")
    n = a.count
    rows, splits = [], {}
    for binding in a.bindings.split(","):
        for t in [int(x) for x in a.threads.split(",")]:
            print(f"{binding}, {t} thread(s): callgrind {n} and {2 * n} messages ...",
                  file=sys.stderr)
            small = run_callgrind(a.exe, binding, t, a.size, n, work)
            large = run_callgrind(a.exe, binding, t, a.size, 2 * n, work)
            per = {i: (large[i][0] - small[i][0]) / n for i in (0, 1)}
            split = defaultdict(float)
            for i in (0, 1):
                for k in set(large[i][1]) | set(small[i][1]):
                    split[k] += (large[i][1].get(k, 0) - small[i][1].get(k, 0)) / n
            sc = None
            if have_perf:
                # Natively, with 20x the messages: a short run's system
                # calls depend on timing more than on its length.
                m = 20 * n
                s1 = run_syscalls(a.exe, binding, t, a.size, m, work)
                s2 = run_syscalls(a.exe, binding, t, a.size, 2 * m, work)
                if s1 is not None and s2 is not None:
                    sc = (s2 - s1) / m
            rows.append((binding, t, per[0], per[1], sc))
            splits[(binding, t)] = split
    shutil.rmtree(work, ignore_errors=True)

    base = {t: tot for (b, t, s, r, _) in rows if b == "raw-tcp-batched" for tot in [s + r]}
    lines = [
        f"# Instructions per message: {a.size} B, uni throughput, "
        f"{n} vs {2 * n} messages",
        "",
        f"Command: `scripts/instructions.py --bindings {a.bindings} --threads {a.threads} "
        f"--size {a.size} --count {n}`",
        "",
        "| binding | threads | sender node | receiver node | both | ÷ raw-tcp-batched | syscalls/msg |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, t, s, r, sc in rows:
        ratio = f"{(s + r) / base[t]:.2f}×" if t in base and base[t] > 0 else "-"
        scs = f"{sc:.3f}" if sc is not None else "-"
        lines.append(f"| {b} | {t} | {s:.0f} | {r:.0f} | {s + r:.0f} | {ratio} | {scs} |")
    cats = [c for c, _ in CATEGORIES] + ["std, libc, kernel entry"]
    lines += ["", "Where they go (instructions per message, both nodes):", ""]
    keys = list(splits)
    lines.append("| part | " + " | ".join(f"{b} t{t}" for b, t in keys) + " |")
    lines.append("|---|" + "---|" * len(keys))
    for c in cats:
        vals = [splits[k].get(c, 0.0) for k in keys]
        if all(abs(v) < 0.5 for v in vals):
            continue
        lines.append(f"| {c} | " + " | ".join(f"{v:.0f}" for v in vals) + " |")
    report = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "instructions.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
