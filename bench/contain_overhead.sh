#!/usr/bin/env bash
# Spawn-to-evidence overhead of `assayd contain -- /bin/true` against `unshare -n /bin/true`
# (the cost of making a network namespace), median of many runs each, interleaved so both see
# the same machine load. Writes the results to bench/contain_overhead.md.
#   usage: bench/contain_overhead.sh [ASSAYD] [RUNS]   (default build-contain/supervisor/assayd, 100)
# Needs root (cgroups, namespaces), like assayd itself.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
assayd=${1:-$here/../build-contain/supervisor/assayd}
runs=${2:-100}
[ -x "$assayd" ] || { echo "contain_overhead: no assayd at $assayd (build target assayd)" >&2; exit 2; }
command -v unshare >/dev/null || { echo "contain_overhead: unshare (util-linux) missing" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
now() { date +%s%N; }
for ((i = 0; i < runs; i++)); do
  t0=$(now); unshare -n /bin/true; t1=$(now)
  echo $((t1 - t0)) >>"$tmp/unshare"
  t0=$(now); "$assayd" contain --name "bench-$$-$i" -- /bin/true >"$tmp/evidence.json"; t1=$(now)
  echo $((t1 - t0)) >>"$tmp/contain"
  # Where the time goes: assayd's own start-up, the mount namespace, the cgroup work.
  t0=$(now); "$assayd" --version >/dev/null; t1=$(now)
  echo $((t1 - t0)) >>"$tmp/startup"
  t0=$(now); unshare -n -m /bin/true; t1=$(now)
  echo $((t1 - t0)) >>"$tmp/unshare_nm"
  t0=$(now); "$assayd" contain --mode none -- /bin/true >/dev/null; t1=$(now)
  echo $((t1 - t0)) >>"$tmp/none"
  t0=$(now); /bin/true; t1=$(now)
  echo $((t1 - t0)) >>"$tmp/true"
done
# The last evidence must say the run was contained, or the numbers mean nothing.
/usr/bin/python3 - "$tmp/evidence.json" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
assert e["exit"]["code"] == 0 and e["mode"] != "none" and e["network"]["namespace"] == "private", e
PY

/usr/bin/python3 - "$tmp" "$runs" "$assayd" "$here/contain_overhead.md" <<'PY'
import json, os, platform, statistics, subprocess, sys, datetime
tmp, runs, assayd, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def ms(name):
    v = [int(x) / 1e6 for x in open(os.path.join(tmp, name))]
    return statistics.median(v), sorted(v)[int(0.9 * (len(v) - 1))]
u_med, u_p90 = ms("unshare")
c_med, c_p90 = ms("contain")
s_med, s_p90 = ms("startup")
m_med, m_p90 = ms("unshare_nm")
n_med, n_p90 = ms("none")
t_med, t_p90 = ms("true")
needed = [l.split("[")[1].rstrip("]\n") for l in subprocess.run(["readelf", "-d", assayd],
          capture_output=True, text=True).stdout.splitlines() if "(NEEDED)" in l]
mode = json.load(open(os.path.join(tmp, "evidence.json")))["mode"]
text = f"""# Containment overhead

`bench/contain_overhead.sh`: spawn-to-evidence time of `assayd contain -- /bin/true` against
`unshare -n /bin/true` (making a network namespace and running the same program), each run
{runs} times, interleaved, wall-clock from the shell. Goal: ratio under 2x.

Last run: {datetime.datetime.utcnow().strftime('%Y-%m-%d %H:%M UTC')}, kernel {platform.release()},
{os.cpu_count()} CPUs, backend `{mode}`, load average at the end {os.getloadavg()[0]:.1f}.

| command | median ms | p90 ms |
|---|---|---|
| `unshare -n /bin/true` (baseline) | {u_med:.2f} | {u_p90:.2f} |
| `assayd contain -- /bin/true` | {c_med:.2f} | {c_p90:.2f} |
| breakdown: `assayd --version` (process start-up only) | {s_med:.2f} | {s_p90:.2f} |
| breakdown: `unshare -n -m /bin/true` (network + mount namespace) | {m_med:.2f} | {m_p90:.2f} |
| breakdown: `assayd contain --mode none -- /bin/true` (no cgroup) | {n_med:.2f} | {n_p90:.2f} |
| floor: `/bin/true` (fork+exec from the shell, timing included) | {t_med:.2f} | {t_p90:.2f} |

**Ratio (median): {c_med / u_med:.2f}x** (p90: {c_p90 / u_p90:.2f}x).

The contained run also makes a mount namespace, creates and removes a leaf cgroup in each
v1 hierarchy (memory, pids, freezer, cpuacct), reads the counters and prints the evidence.
Cost of the cgroup work (median): {c_med - n_med:.2f} ms; of the mount namespace on top of the
network one: {m_med - u_med:.2f} ms; of starting the assayd binary: {s_med:.2f} ms
({s_med - t_med:.2f} ms more than `/bin/true`). assayd's shared libraries: {", ".join(needed)}.
"""
# Hand-written notes below "## History" in the previous file are kept.
old = open(out).read() if os.path.exists(out) else ""
history = old[old.find("\n## History"):] if "\n## History" in old else ""
open(out, "w").write(text + history)
print(text)
PY
