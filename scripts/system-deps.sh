#!/bin/sh
# The system libraries the Mooncake Store wheel links against (libibverbs1, librdmacm1; its TCP
# transport needs no RDMA hardware). Installed with apt when missing (as root, or with sudo that
# needs no password); otherwise this says what to install and leaves the rest of HYPIC working.
have() { python3 -c "import ctypes; ctypes.CDLL('libibverbs.so.1'); ctypes.CDLL('librdmacm.so.1')" 2>/dev/null; }
have && exit 0
if [ "$(id -u)" = 0 ]; then run=""; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then run="sudo -n"
else run="none"; fi
if [ "$run" != none ] && command -v apt-get >/dev/null; then
  $run apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1 >/dev/null 2>&1 ||
    { $run apt-get update -q >/dev/null 2>&1 && $run apt-get install -y -q --no-install-recommends libibverbs1 librdmacm1 >/dev/null; }
fi
have || echo "system-deps: install libibverbs1 and librdmacm1 (e.g. apt-get install libibverbs1 librdmacm1) for the Mooncake tier and its tests" >&2
exit 0
