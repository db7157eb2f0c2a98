#!/usr/bin/env bash
# Soft-RoCE (rdma_rxe) for testing the RDMA data plane on a host without an RDMA NIC.
#   sudo kvtier/pool/rxe_setup.sh up IFACE     # modprobe rdma_rxe; rdma link add rxe0 type rxe netdev IFACE
#   sudo kvtier/pool/rxe_setup.sh check        # device, port state, GIDs (then: pytest -m rdma)
#   sudo kvtier/pool/rxe_setup.sh down         # rdma link delete rxe0
# Refuses, with the reason, where the kernel has no rdma_rxe (many cloud and container kernels).
set -euo pipefail
DEV=${RXE_DEV:-rxe0}

die() { echo "rxe_setup: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || die "$1 not found (install iproute2 / rdma-core / ibverbs-utils)"; }

has_rxe() {
  [ -d /sys/module/rdma_rxe ] || modinfo rdma_rxe >/dev/null 2>&1
}

up() {
  local iface=${1:-}
  [ -n "$iface" ] || die "usage: $0 up IFACE (an Ethernet netdev with an IPv4 address)"
  [ -e "/sys/class/net/$iface" ] || die "no network interface $iface"
  need rdma
  has_rxe || die "this kernel ($(uname -r)) has no rdma_rxe module (CONFIG_RDMA_RXE); soft-RoCE is not possible here"
  [ "$(id -u)" = 0 ] || die "must run as root (modprobe, rdma link add)"
  modprobe rdma_rxe || die "modprobe rdma_rxe failed"
  if rdma link show "$DEV/1" >/dev/null 2>&1; then
    echo "rxe_setup: $DEV already exists"
  else
    rdma link add "$DEV" type rxe netdev "$iface" || die "rdma link add $DEV type rxe netdev $iface failed"
  fi
  check
}

check() {
  [ -d "/sys/class/infiniband/$DEV" ] || die "$DEV does not exist (run: $0 up IFACE)"
  local state
  state=$(cat "/sys/class/infiniband/$DEV/ports/1/state")
  echo "rxe_setup: $DEV port 1: $state"
  for t in /sys/class/infiniband/$DEV/ports/1/gid_attrs/types/*; do
    local i=${t##*/} type gid
    type=$(cat "$t" 2>/dev/null) || continue
    gid=$(cat "/sys/class/infiniband/$DEV/ports/1/gids/$i")
    [ "$gid" = "0000:0000:0000:0000:0000:0000:0000:0000" ] || echo "  GID $i: $gid ($type)"
  done
  case $state in *ACTIVE*) ;; *) die "port is not ACTIVE: bring the netdev up";; esac
  echo "rxe_setup: ready; run: python -m kvtier doctor && pytest -m rdma"
}

down() {
  need rdma
  if rdma link show "$DEV/1" >/dev/null 2>&1; then rdma link delete "$DEV"; echo "rxe_setup: $DEV removed"
  else echo "rxe_setup: $DEV not present"; fi
}

case ${1:-} in
  up) up "${2:-}" ;;
  check) check ;;
  down) down ;;
  *) die "usage: $0 up IFACE | check | down" ;;
esac
