#!/bin/bash
# Install what tests/test_slurm.py runs, where it is missing: Debian's slurmctld, slurmd,
# slurm-client and munge (`make test-slurm` calls this). Needs root or password-less sudo; the
# packages' services are not started here (the tests start their own daemons).
set -euo pipefail

missing=()
for cmd in munged slurmctld slurmd sbatch srun squeue sinfo scontrol scancel; do
    command -v "$cmd" > /dev/null || [[ -x /usr/sbin/$cmd ]] || missing+=("$cmd")
done
(( ${#missing[@]} == 0 )) && exit 0

if [[ $(id -u) == 0 ]]; then
    sudo=()
elif sudo -n true 2> /dev/null; then
    sudo=(sudo)
else
    echo "error: Slurm is not installed (${missing[*]} missing) and installing it needs root: run" \
         "\`sudo apt-get install slurmctld slurmd slurm-client munge\`, then make test-slurm again" >&2
    exit 2
fi
packages=(slurmctld slurmd slurm-client munge)
echo "installing ${packages[*]} (Debian's packages; ${missing[*]} missing)"
export DEBIAN_FRONTEND=noninteractive
install() { "${sudo[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}" > /dev/null; }
install || { "${sudo[@]}" apt-get update -q > /dev/null && install; }
