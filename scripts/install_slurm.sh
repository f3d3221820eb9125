#!/usr/bin/env bash
# One-time install of what the real-Slurm tests (tests/commands/test_slurm.py) need: Debian's slurm-wlm and
# munge.  Idempotent and quiet: does nothing when slurmctld, slurmd, munged and sbatch are already
# there.  Needs root (apt-get).  The tests start their own private cluster; nothing is started here.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have slurmctld && have slurmd && have munged && have sbatch; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_slurm: not root; as root run: apt-get update && apt-get install -y slurm-wlm munge" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
echo "install_slurm: installed slurm-wlm and munge ($(slurmctld -V 2>/dev/null || echo '?'))"
