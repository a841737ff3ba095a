#!/usr/bin/env bash
# Builds the pinned control-plane and tool binaries from the Go module proxy and the Debian archive,
# caching each under ~/.cache/rlfleet/<name>-<version>/bin. Idempotent: a binary already in the
# cache is not rebuilt. Prints one line per binary.
set -euo pipefail

KUBERNETES_VERSION=${KUBERNETES_VERSION:-v1.35.4}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
HELM_VERSION=${HELM_VERSION:-v3.22.0}
PROMETHEUS_DEB_VERSION=${PROMETHEUS_DEB_VERSION:-2.42.0+ds-5+deb12u1}
CACHE=${RLFLEET_CACHE:-$HOME/.cache/rlfleet}
export GOFLAGS=-mod=mod GOTOOLCHAIN=local

have() { [ -x "$1" ] && echo "cached  $1"; }

build_kubernetes() {
  local out="$CACHE/kubernetes-$KUBERNETES_VERSION/bin"
  if have "$out/kube-apiserver" && have "$out/kube-controller-manager" && have "$out/kubectl"; then return; fi
  local work; work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  cd "$work"
  go mod init rlfleet.local/k8sbuild >/dev/null 2>&1
  local modfile; modfile=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  # The staging modules are replaced by directory in k8s.io/kubernetes' go.mod; a consumer must name
  # their published v0.X.Y versions instead.
  local minor=${KUBERNETES_VERSION#v1.}
  local staging; staging=$(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\1#p' "$modfile")
  {
    echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
    echo "replace ("
    for m in $staging; do echo "  $m => $m v0.$minor"; done
    echo ")"
  } >> go.mod
  cat > tools.go <<'GO'
//go:build tools
package tools
import (
  _ "k8s.io/kubernetes/cmd/kube-apiserver"
  _ "k8s.io/kubernetes/cmd/kube-controller-manager"
  _ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  # -e: tidy also walks the tests of dependencies, some of which import packages that no published
  # module holds; the binaries do not need them.
  go mod tidy -e >/dev/null 2>&1
  local ver=$KUBERNETES_VERSION
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$ver -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*} -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$ver -X k8s.io/client-go/pkg/version.gitMajor=1 -X k8s.io/client-go/pkg/version.gitMinor=${minor%%.*}"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  go build -trimpath -ldflags "$ld" -o "$out.tmp/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl
  rm -rf "$out"; mkdir -p "$(dirname "$out")"; mv "$out.tmp" "$out"
  echo "built   $out (kube-apiserver, kube-controller-manager, kubectl $ver)"
}

build_etcd() {
  local out="$CACHE/etcd-$ETCD_VERSION/bin"
  if have "$out/etcd"; then return; fi
  local work; work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  cd "$work"
  go mod init rlfleet.local/etcdbuild >/dev/null 2>&1
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3
  rm -rf "$out"; mv "$out.tmp" "$out"
  echo "built   $out/etcd $ETCD_VERSION"
}

build_helm() {
  local out="$CACHE/helm-$HELM_VERSION/bin"
  if have "$out/helm"; then return; fi
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"
  echo "built   $out/helm $HELM_VERSION"
}

fetch_prometheus() {
  local short=${PROMETHEUS_DEB_VERSION%%+*}
  local out="$CACHE/prometheus-$short/bin"
  if have "$out/prometheus" && have "$out/promtool"; then return; fi
  local work; work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  cd "$work"
  # Download and unpack only: no service is installed or started on the machine.
  apt-get download "prometheus=$PROMETHEUS_DEB_VERSION" >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get download "prometheus=$PROMETHEUS_DEB_VERSION" >/dev/null; }
  dpkg-deb -x prometheus_*.deb root
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  cp root/usr/bin/prometheus root/usr/bin/promtool "$out.tmp/"
  rm -rf "$out"; mv "$out.tmp" "$out"
  echo "built   $out (prometheus, promtool $short)"
}

# One build at a time per cache: concurrent set-ups (two checkouts, CI) wait instead of racing.
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9

targets=${*:-kubernetes etcd helm prometheus}
for t in $targets; do
  case $t in
    kubernetes) (build_kubernetes) ;;
    etcd) (build_etcd) ;;
    helm) (build_helm) ;;
    prometheus) (fetch_prometheus) ;;
    *) echo "unknown target $t" >&2; exit 2 ;;
  esac
done
