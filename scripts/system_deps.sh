#!/usr/bin/env bash
# System packages the scale-out paths need, installed once (idempotent; CI calls it before `make test`):
#   libaio-dev      DeepSpeed's async_io op (NVMe offload, ZeRO-Infinity) links against libaio
#   slurm-wlm munge a real single-host Slurm for tests/launch/test_slurm.py (slurmctld + slurmd on loopback)
# Then JIT-builds DeepSpeed's async_io op into the torch extensions cache (~280 s the first time), so no test or
# run pays for it mid-flight. Without root or apt-get it says so and exits 0: the tests that need these skip.
set -uo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(libaio-dev slurm-wlm munge)
missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "system_deps: ${PACKAGES[*]} already installed"
elif [ "$(id -u)" -ne 0 ]; then
    echo "system_deps: not root, skipping apt-get install ${missing[*]} (NVMe and Slurm tests will skip)"
elif ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps: no apt-get here, skipping ${missing[*]} (NVMe and Slurm tests will skip)"
else
    echo "system_deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # No init system in containers: keep the packages' postinst from trying to start munge/slurm daemons
    # (the Slurm test starts its own, on a private config, and stops them after).
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && made_policy=1
    fi
    apt-get -o DPkg::Lock::Timeout=300 update -qq \
        && apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    status=$?
    [ "$made_policy" -eq 1 ] && rm -f "$policy"
    if [ $status -ne 0 ]; then
        echo "system_deps: apt-get failed ($status); NVMe and Slurm tests will skip"
        exit 0
    fi
fi

PY=.venv/bin/python
if [ -x "$PY" ] && [ -e /usr/include/libaio.h ]; then
    echo "system_deps: building DeepSpeed's async_io op (~280 s the first time, instant after)"
    "$PY" -m hf_zero.core.ops AsyncIOBuilder || echo "system_deps: async_io build failed; NVMe tests will skip"
fi
exit 0
