#!/usr/bin/env bash
# Start the stable-diffusion server: build the archive from MODEL_DIR (skipped when unchanged), then
# serve it in the foreground until Ctrl-C or SIGTERM. `make serve` and the container run this script.
#
# Environment (defaults in brackets; relative paths are relative to the repository):
#   PYTHON          Python with the pinned dependencies [.venv/bin/python, else python3]
#   MODEL_DIR       diffusers directory or single-file .safetensors checkpoint to package; empty: serve the model store as it is [models/shapes-sd]
#   MODEL_STORE     where the archive is written and served from [model_store]
#   MODEL_CONFIG    model-config.yaml packaged with the archive [model-config.yaml]
#   ARCHIVE_FORMAT  auto | default | no-archive [auto]
#   CONFIG          TorchServe config.properties [config.properties]
#   WORKDIR         TorchServe's working directory: key_file.json, logs/ [runtime]
#   BIND_ADDRESS    listen on this host instead of the config's (0.0.0.0 in a container) [unset]
#   LORA_DIR        LoRA adapters requests may name (handler.loras.dir in model-config.yaml wins) [loras]
#   CONTROLNET_DIR  ControlNets requests may name (handler.controlnets.dir wins) [controlnets]
#   STOP_GRACE_SECONDS  on SIGTERM/Ctrl-C, seconds the requests in flight get to finish (new ones get 503)
#                   [the archive's request time limit + 5: 275 with the shipped model-config.yaml]
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MODEL_DIR="${MODEL_DIR-models/shapes-sd}"
MODEL_STORE="${MODEL_STORE:-model_store}"
CONFIG="${CONFIG:-config.properties}"
WORKDIR="${WORKDIR:-runtime}"
LORA_DIR="$(realpath -m "${LORA_DIR:-loras}")"
CONTROLNET_DIR="$(realpath -m "${CONTROLNET_DIR:-controlnets}")"
export LORA_DIR CONTROLNET_DIR  # the workers inherit TorchServe's environment

if [[ -n "$MODEL_DIR" ]]; then
  "$PYTHON" -m server.archive --model-dir "$MODEL_DIR" --export-path "$MODEL_STORE" \
    --config "${MODEL_CONFIG:-model-config.yaml}" --archive-format "${ARCHIVE_FORMAT:-auto}"
fi
exec "$PYTHON" -m server.cli --config "$CONFIG" --model-store "$MODEL_STORE" --workdir "$WORKDIR" \
  ${BIND_ADDRESS:+--bind "$BIND_ADDRESS"} ${STOP_GRACE_SECONDS:+--stop-grace "$STOP_GRACE_SECONDS"}
