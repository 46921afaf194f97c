#!/usr/bin/env bash
# Per-rank shim: map the rank variables that an MPI or Slurm launcher sets onto the torch.distributed
# ones (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_SIZE = LOCAL_WORLD_SIZE) and exec the command given.
#
#     mpiexec -n 2 launch/rank_env.sh python -u launch/train.py --deepspeed_config ...
#
# launch/mpirun.sh and launch/slurm.sbatch put it in front of every rank. With all five of RANK,
# WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, deepspeed.init_distributed() goes straight
# to env:// and skips its mpi4py discovery, which would overwrite MASTER_ADDR with the first address
# of `hostname -I` on rank 0 (never loopback, and on a cluster possibly the wrong network).
#
# Sources, first match wins:
#   Open MPI          OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}
#   MPICH / Intel MPI PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS   (Hydra)
#   PMIx launchers    PMIX_RANK (+ PMI_SIZE / PALS_* where set)
#   Slurm srun        SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE
# (MPI variables win over Slurm ones: ranks that Hydra or Open MPI starts under Slurm inherit the
# SLURM_PROCID of their node's proxy.)
# MASTER_ADDR and MASTER_PORT must come from the caller (mpirun.sh exports them to every rank).
set -euo pipefail

first() {  # first non-empty value among the named variables
    local v
    for v in "$@"; do
        if [[ -n "${!v:-}" ]]; then printf '%s' "${!v}"; return 0; fi
    done
    return 1
}

if ! RANK=$(first OMPI_COMM_WORLD_RANK PMI_RANK PMIX_RANK SLURM_PROCID); then
    echo "rank_env.sh: no MPI/Slurm rank variable found (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK, SLURM_PROCID);" \
         "run me under mpiexec, mpirun or srun" >&2
    exit 2
fi
WORLD_SIZE=$(first OMPI_COMM_WORLD_SIZE PMI_SIZE SLURM_NTASKS WORLD_SIZE) || {
    echo "rank_env.sh: no world size variable (OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS, WORLD_SIZE)" >&2; exit 2; }
LOCAL_RANK=$(first OMPI_COMM_WORLD_LOCAL_RANK MPI_LOCALRANKID PALS_LOCAL_RANKID SLURM_LOCALID) || LOCAL_RANK=0
LOCAL_SIZE=$(first OMPI_COMM_WORLD_LOCAL_SIZE MPI_LOCALNRANKS PALS_LOCAL_SIZE LOCAL_SIZE) || LOCAL_SIZE=""
if [[ -z "$LOCAL_SIZE" ]]; then              # srun: "8(x2)" or "8,4" -> 8 (equal counts per node assumed)
    LOCAL_SIZE=$(first SLURM_STEP_TASKS_PER_NODE SLURM_TASKS_PER_NODE SLURM_NTASKS_PER_NODE) || LOCAL_SIZE=""
    LOCAL_SIZE=${LOCAL_SIZE%%[(,]*}
fi
LOCAL_SIZE=${LOCAL_SIZE:-$WORLD_SIZE}

: "${MASTER_ADDR:?rank_env.sh: MASTER_ADDR is not set (launch/mpirun.sh exports it)}"
: "${MASTER_PORT:=29500}"
LOCAL_WORLD_SIZE=$LOCAL_SIZE                 # torchrun's name for it
export RANK WORLD_SIZE LOCAL_RANK LOCAL_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT

if [[ "${SLACKSWAP_LAUNCH_VERBOSE:-0}" == 1 ]]; then
    echo "rank_env.sh: $(hostname) RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK LOCAL_SIZE=$LOCAL_SIZE" \
         "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT" >&2
fi
exec "$@"
