#!/usr/bin/env bash
# One node of a torchrun job on machines you start yourself (bare VMs, a RunPod instant cluster):
# run this on every node with the same SYNC_TARGET, NNODES and MASTER_ADDR, and its own NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 SYNC_TARGET=s3://my-bucket/run1 ./torchrun-node.sh
# train-supervisor is installed as the README says (systemd/install.sh); [cluster] takes the node's
# rank and the node count from NODE_RANK and NNODES in its environment file, so every node writes
# the same config. A RunPod instant cluster sets NODE_RANK and NUM_NODES itself.
set -euo pipefail
: "${NNODES:?}" "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${SYNC_TARGET:?}"
GPUS="${GPUS_PER_NODE:-8}"
WORKDIR="${WORKDIR:-$PWD}"

sudo tee /etc/train-supervisor/config.toml >/dev/null <<TOML
price_per_hour = 31.20
[training]
workdir = "$WORKDIR"
log = "$WORKDIR/train.log"
on_finish = "stop"
[sync]
target = "$SYNC_TARGET"
watch = ["$WORKDIR/out"]
[stop]
action = "poweroff"
[cluster]
heartbeat = "15s"
silent_after = "60s"
on_node_lost = "save_and_stop"
[budget]
scope = "run"
[resume]
from_target = true
TOML
# this node's place in the run, read afresh at every start of the daemon
sudo touch /etc/train-supervisor/environment
sudo sed -i '/^\(NODE_RANK\|NNODES\)=/d' /etc/train-supervisor/environment
printf 'NODE_RANK=%s\nNNODES=%s\n' "$NODE_RANK" "$NNODES" | sudo tee -a /etc/train-supervisor/environment >/dev/null
sudo supervisorctl check-config
sudo train-supervisor-start --restart
sudo supervisorctl run -- torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS" \
  --master_addr "$MASTER_ADDR" --master_port 29500 train.py --output_dir "$WORKDIR/out"
sudo supervisorctl status --cluster || true
