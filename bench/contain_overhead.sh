#!/usr/bin/env bash
# Spawn-to-evidence overhead of `assayd contain -- /bin/true` against `unshare -n /bin/true`,
# median of many interleaved runs, timed from posix_spawn to waitpid (contain_overhead.py).
# Writes the results to bench/contain_overhead.md.
#   usage: bench/contain_overhead.sh [ASSAYD] [RUNS]   (default build/supervisor/assayd, 200)
# Needs root (cgroups, namespaces), like assayd itself.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
assayd=${1:-$here/../build/supervisor/assayd}
runs=${2:-200}
exec /usr/bin/python3 "$here/contain_overhead.py" "$assayd" "$runs"
