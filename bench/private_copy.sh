#!/usr/bin/env bash
# The oracle's private copy of a weight file, six ways (bench/private_copy.cpp): anonymous
# memory with MADV_HUGEPAGE (what worker/model_files.cpp did until 2026-12-07), the same with
# 4 KiB pages; a second thread faulting the pages in ahead of the reader, in the page size its
# first two steps measured faster (what it does now), always in huge or always in 4 KiB pages;
# and a sealed memfd filled by sendfile (no page zeroed before it is overwritten).
# Each is timed on the largest shard of the Qwen3-4B-shaped checkpoint (page cache warm) in two
# conditions: "warm", right after a run of the same method freed its memory, and "after idle",
# after IDLE seconds in which the host may take freed memory back (a VM with free page reporting
# does). Medians of ROUNDS runs; ratios against anon-hugepage in the same run.
# Usage: bench/private_copy.sh [--file F] [--idle S] [--rounds N]   Writes bench/private_copy.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
file=""
idle=15
rounds=3
while [ $# -gt 0 ]; do
  case $1 in
    --file) file=$2; shift 2 ;;
    --idle) idle=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--file F] [--idle S] [--rounds N]" >&2; exit 2 ;;
  esac
done
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
if [ -z "$file" ]; then
  qwen=/var/tmp/assay-bench-qwen3-4b
  [ -f "$qwen/config.json" ] ||
    "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --seed 0 --out "$qwen" >/dev/null
  file=$(ls -S "$qwen"/*.safetensors | head -1)
fi
work=$(mktemp -d /var/tmp/assay-private-copy.XXXXXX)
trap 'rm -rf "$work"' EXIT
g++ -O2 -std=c++20 -I"$root" -o "$work/probe" "$root/bench/private_copy.cpp"
cat "$file" >/dev/null  # page cache warm
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
methods=(anon-hugepage anon-4k anon-prefault anon-huge-prefault anon-4k-prefault memfd)
for ((r = 0; r < rounds; r++)); do
  for m in "${methods[@]}"; do
    sleep "$idle"
    "$work/probe" "$m" "$file" | sed 's/^{/{"condition": "after idle", /' >>"$work/rows.jsonl"
    "$work/probe" "$m" "$file" | sed 's/^{/{"condition": "warm", /' >>"$work/rows.jsonl"
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
capability=$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())' 2>/dev/null || echo unknown)
reporting=no
for f in /sys/bus/virtio/drivers/virtio_balloon/virtio*/features; do
  [ -f "$f" ] && [ "$(cut -c6 "$f")" = 1 ] && reporting=yes
done
"$py" - "$work/rows.jsonl" "$root/bench/private_copy.md" "$file" "$cpu" "$capability" "$idle" \
  "$rounds" "$load_before" "$load_after" "$reporting" \
  "$(cat /sys/kernel/mm/transparent_hugepage/enabled)" "$(cat /sys/kernel/mm/transparent_hugepage/defrag)" <<'PY'
import json, os, statistics, sys, time
rows = [json.loads(l) for l in open(sys.argv[1])]
out, path, cpu, cap, idle, rounds, lb, la, reporting, thp, defrag = sys.argv[2:]
size = rows[0]["bytes"]
def med(method, cond, key):
    return statistics.median(r[key] for r in rows if r["method"] == method and r["condition"] == cond)
md = ["# The oracle's private copy of a weight file (`bench/private_copy.sh`)", "",
      "Run %s UTC. CPU: %s, %d CPUs (`ATEN_CPU_CAPABILITY` %s; ATen is not involved here); kernel %s; "
      "transparent huge pages `%s`, defrag `%s`; virtio free page reporting: %s. Load average %s before, %s after." % (
          time.strftime("%Y-%m-%d %H:%M", time.gmtime()), cpu, os.cpu_count(), cap, os.uname().release,
          thp, defrag, reporting, lb, la), "",
      "File: `%s`, %d bytes, in the page cache. Medians of %s runs per cell. **copy**: until the read-only image exists; "
      "**touch**: one byte of every 4 KiB page afterwards (faults a lazily mapped image pays later); **free**: unmapping it "
      "(what the worker pays at exit). *After idle*: the run follows %s s of sleep; *warm*: it follows a run of the same method "
      "that has just freed its memory. Baseline: `anon-hugepage`, what `worker/model_files.cpp` did until 2026-12-07; it now does `anon-prefault`." % (
          path, size, rounds, idle), "",
      "| method | condition | copy (s) | touch (s) | free (s) | total (s) | GB/s | **total / anon-hugepage** |",
      "|---|---|---|---|---|---|---|---|"]
for cond in ("after idle", "warm"):
    base = sum(med("anon-hugepage", cond, k) for k in ("copy_s", "touch_s", "free_s"))
    for m in ("anon-hugepage", "anon-4k", "anon-prefault", "anon-huge-prefault", "anon-4k-prefault", "memfd"):
        c, t, f = (med(m, cond, k) for k in ("copy_s", "touch_s", "free_s"))
        md.append("| %s | %s | %.3f | %.3f | %.3f | %.3f | %.2f | **%.2fx** |" % (
            m, cond, c, t, f, c + t + f, size / 1e9 / (c + t + f), (c + t + f) / base))
md += ["", "A probe's copy is not a job's: the oracle holds every shard at once (8 GB here) and copies two at a time, and pays the free column at every exit; `bench/resident.sh` times whole jobs."]
md += ["", "Every run, in order: " + "; ".join("%s %s %.2f/%.2f/%.2f" % (
    r["method"], r["condition"], r["copy_s"], r["touch_s"], r["free_s"]) for r in rows) + ".", ""]
open(out, "w").write("\n".join(md))
print("\n".join(md))
PY
