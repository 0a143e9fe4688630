#!/usr/bin/env bash
# Issue 27's benchmark (bench/resident.py, one run on this machine): a next-token job cold and
# repeated, with and without a resident oracle worker, against transformers' eager forward of
# the same model and ids and against the forward alone; N repeat single jobs against one
# N-state batch. Cases: the small llama fixture and the Qwen3-4B-shaped 8 GB checkpoint (kept in
# /var/tmp/assay-bench-qwen3-4b, as bench/oracle_vs_hf.sh keeps it), T=42.
# Usage: bench/resident.sh [--build DIR] [--no-4b] [--many N]   (CONTAINMENT=auto|none)
# Writes bench/resident.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build
big=1
many=100
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --no-4b) big=0; shift ;;
    --many) many=$2; shift 2 ;;
    -h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $0 [--build DIR] [--no-4b] [--many N]" >&2; exit 2 ;;
  esac
done
py=${ASSAY_PYTHON3:-/opt/assay/venv/bin/python}
for b in "$build/supervisor/assayd" "$build/fingerprint/assay-fingerprint" "$build/worker/assay-oracle"; do
  [ -x "$b" ] || { echo "missing $b" >&2; exit 2; }
done
work=$(mktemp -d /var/tmp/assay-resident-bench.XXXXXX)
trap 'pkill -f "serve --socket $work" 2>/dev/null || true; rm -rf "$work"' EXIT
chmod 755 "$work"
"$py" "$root/tests/fixtures/make_fixture.py" --arch llama --size small --out "$work/small" >/dev/null
cases=(--case "small:$work/small:42")
if [ "$big" = 1 ]; then
  qwen=/var/tmp/assay-bench-qwen3-4b
  [ -f "$qwen/config.json" ] ||
    "$py" "$root/tests/fixtures/make_fixture.py" --arch qwen3 --size 4b --shards 4 --seed 0 --out "$qwen" >/dev/null
  cases+=(--case "qwen3-4b:$qwen:42")
fi
# "Page cache warm" for every measurement, the eager reference's included: the models' files
# read once, and torch and transformers imported once (their files cached) before any timing.
for c in "${cases[@]}"; do
  [ "$c" = --case ] || cat "$(echo "$c" | cut -d: -f2)"/* >/dev/null
done
"$py" -c 'import torch, transformers' 2>/dev/null
sleep 2.1  # the fingerprint cache keeps no digest of a file changed in the last 2 s
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
"$py" "$root/bench/resident.py" --build "$build" "${cases[@]}" --work "$work" \
  --out "$work/rows.json" --many "$many" --containment "${CONTAINMENT:-auto}"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
capability=$("$py" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
# What the host does to memory behind the benchmark's back (a VM here): DAMON schemes that page
# out idle pages, and virtio free page reporting (freed memory handed back to the host).
damon=none
for k in /sys/kernel/mm/damon/admin/kdamonds/[0-9]*; do
  [ -d "$k" ] || continue
  [ "$damon" = none ] && damon=""
  damon="$damon$(cat "$k/state") $(cat "$k"/contexts/*/schemes/*/action 2>/dev/null | tr '\n' ' ')"
done
reporting=no
for f in /sys/bus/virtio/drivers/virtio_balloon/virtio*/features; do
  [ -f "$f" ] && [ "$(cut -c6 "$f")" = 1 ] && reporting=yes
done
"$py" - "$work/rows.json" "$root/bench/resident.md" "$cpu" "$capability" "$load_before" "$load_after" \
  "${CONTAINMENT:-auto}" "$damon" "$reporting" <<'PY'
import json, os, sys, time
rows = json.load(open(sys.argv[1]))
out, cpu, cap, lb, la, mode, damon, reporting = sys.argv[2:]
md = ["# Resident oracle workers (`bench/resident.sh`)", "",
      "Run %s UTC. CPU: %s, %d CPUs, `ATEN_CPU_CAPABILITY` %s; containment `%s`; load average %s before, %s after. "
      "Workers run with %d intra-op thread(s) (every CPU of assayd's affinity, config worker_threads 0); transformers with the same." % (
          time.strftime("%Y-%m-%d %H:%M", time.gmtime()), cpu, os.cpu_count(), cap, mode, lb, la,
          len(os.sched_getaffinity(0))),
      "",
      "Host memory management seen: DAMON kdamonds `%s`; virtio free page reporting: %s. With a DAMON `pageout` scheme the page cache the script warms first is paged out again once idle, so \"page cache warm\" may not hold for every measurement (an import or a load that reads the disk shows in the details below)." % (damon.strip(), reporting),
      "",
      "One run, each figure measured in it. A job's wall: from its POST to the first poll (every 5 ms) that shows it succeeded, through a real assayd (fingerprint worker, oracle, signed result). "
      "**Eager reference**: transformers' eager forward of the same model and ids in a fresh process (import, load, bf16 forward, F32 logits written; `bench/oracle_vs_hf.py`'s script). "
      "**Forward alone**: the oracle's own forward_seconds in the repeat jobs (median). "
      "**Cold**: a fresh assayd state directory (fingerprint cache cold), page cache warm. "
      "**Repeat**: the next job on the same model (fingerprint cache warm); with resident workers it runs on the worker the cold job loaded (median of the repeats). "
      "The fs-verity path needs a kernel with CONFIG_FS_VERITY, which this host lacks: no figures with fs-verity here (tests/vm/verity.sh runs that path in the VM, under emulation, too slow to time).",
      "",
      "| case | T | eager reference (s) | forward alone (s) | cold job, one-shot (s) | cold job, resident (s) | **cold / eager** | repeat, one-shot (s) | repeat, resident (s) | **repeat / forward** | repeat / eager |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    cold = min(r["cold_oneshot"], r["cold_resident"])
    md.append("| %s | %d | %.2f | %.3f | %.2f | %.2f | **%.2fx** | %.2f | %.3f | **%.2fx** | %.3fx |" % (
        r["case"], r["T"], r["hf_wall"], r["forward_alone"], r["cold_oneshot"], r["cold_resident"],
        r["cold_resident"] / r["hf_wall"], r["repeat_oneshot"], r["repeat_resident"],
        r["repeat_resident"] / r["forward_alone"], r["repeat_resident"] / r["hf_wall"]))
md += ["", "| case | N | N repeat single jobs, resident (s) | one N-state batch (s) | **singles / batch** | batch on the same resident worker | logits equal (state 0) |",
       "|---|---|---|---|---|---|---|"]
for r in rows:
    md.append("| %s | %d | %.2f | %.2f | **%.2fx** | %s | %s |" % (
        r["case"], r["many"], r["many_singles"], r["many_batch"], r["many_singles"] / r["many_batch"],
        "yes" if r.get("batch_on_resident") else "no", "yes" if r["logits_equal"] else "NO"))
md += ["", "Details per case (seconds): transformers' import / load / forward; the cold one-shot oracle's load and forward; each repeat job on the resident worker; the server's duration_seconds of a repeat job (job start to sealed result).", ""]
for r in rows:
    md.append("- %s: eager %.2f / %.2f / %.3f; one-shot oracle load %.2f, forward %.3f; repeats %s; server %.3f." % (
        r["case"], r["hf_import"], r["hf_load"], r["hf_forward"], r["cold_oneshot_oracle_load"],
        r["cold_oneshot_oracle_forward"], ", ".join("%.3f" % w for w in r["repeat_resident_all"]),
        r["repeat_server_seconds"]))
md += ["", "A cold job's oracle load is its private copy of the weights into fresh memory, which on a VM that hands freed memory back to its host (free page reporting) costs most after the machine was idle: `bench/private_copy.sh` times that copy alone, three ways.", ""]
md += ["", "Goals (issue 27): cold job at most 1.0x the eager reference; repeat job at most 1.2x the forward alone; N repeat single jobs at most 1.2x an N-state batch.", ""]
open(out, "w").write("\n".join(md))
print("\n".join(md))
PY
