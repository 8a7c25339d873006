#!/bin/bash
# Train a vldist job with torchrun across nodes: run this same command on every node, and again on
# a node that comes back after it was lost (by hand, systemd or a scheduler). The agents meet at
# RDZV_ENDPOINT (c10d: node 0's agent holds the store); a failed rank or a lost node restarts the
# ranks (up to MAX_RESTARTS), and every start resumes from the newest checkpoint of output.dir,
# which must be on a disk every node shares (or set output.checkpoint_dir to a store URL).
#
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 RUN_ID=vsrn-1 \
#       cluster/torchrun/train.sh vsrn output.dir=/shared/runs/vsrn train.save_every_steps=500
#
# TORCHRUN_ARGS adds torchrun options (--local-addr, --rdzv-conf is_host=1, ...); PYTHON picks
# the interpreter.
set -euo pipefail

# torch >= 2.4 shares the rendezvous store with the ranks, and a surviving agent then never
# publishes a new round's master address: a node started again waits for it until the rendezvous
# times out (pytorch/pytorch#147064). With this set every round publishes it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

: "${NNODES:?set NNODES, the number of nodes (or MIN:MAX)}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT, host:port of the rendezvous (node 0)}"
: "${RUN_ID:?set RUN_ID, the same on every node of one job}"
JOB=${1:-vsrn}
shift || true

# train.resume=auto comes first, so that an explicit train.resume=... given here wins.
# TORCHRUN_ARGS is split into words on purpose: it holds several options.
# shellcheck disable=SC2086
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "${NPROC_PER_NODE:-1}" \
    --max-restarts "${MAX_RESTARTS:-3}" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RUN_ID" \
    ${TORCHRUN_ARGS:-} -m vldist.train "$JOB" train.resume=auto "$@"
