#!/usr/bin/env bash
# Run launch/train.py (or any script) under mpiexec / mpirun, MPICH (Hydra) or Open MPI.
#
#   launch/mpirun.sh [-n N] [--ppn P] [--hostfile FILE] [--port PORT] [--mpi-args "ARGS"] [--dry-run] \
#                    [--] SCRIPT [SCRIPT ARGS...]
#
#   # 2 CPU ranks on this machine, loopback only:
#   SLACKSWAP_LOOPBACK=1 DS_ACCELERATOR=cpu launch/mpirun.sh -n 2 launch/train.py \
#       --deepspeed_config configs/slackswap.json --steps 5
#   # 2 nodes x 8 GPUs (DeepSpeed hostfile format, "worker-1 slots=8"; needs passwordless ssh and a
#   # shared filesystem, as mpiexec itself does):
#   launch/mpirun.sh --hostfile launch/hostfile.example launch/train.py --deepspeed_config configs/gpt2-xl.json
#
# Every rank runs through launch/rank_env.sh, which turns the launcher's rank variables (PMI_RANK,
# OMPI_COMM_WORLD_RANK, ...) into RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_SIZE, so that
# deepspeed.init_distributed() takes env:// and never runs its mpi4py discovery (which would set
# MASTER_ADDR to the first address of `hostname -I`). Training traffic is torch.distributed's
# (gloo / nccl); MPI starts the processes and, when mpi4py is installed, carries slackswap_ds's plan
# agreement (config "sync": "auto" picks MPI when PMI_RANK / OMPI_COMM_WORLD_RANK is set).
#
# Options:
#   -n, -np N        number of ranks (default: sum of the hostfile's slots; else the number of GPUs
#                    `nvidia-smi -L` lists; else 1)
#   --ppn P          ranks per node (default: the hostfile's slots of its first host)
#   --hostfile FILE  DeepSpeed / Open MPI hostfile ("host slots=N" per line, # comments)
#   --port PORT      MASTER_PORT (default: $MASTER_PORT, else 29500)
#   --mpi-args STR   extra arguments for mpiexec, word-split (also $SLACKSWAP_MPI_ARGS)
#   --dry-run        print the command and exit
# Environment:
#   SLACKSWAP_LOOPBACK=1   keep everything on lo: MPICH `-iface lo`; Open MPI `--mca btl_tcp_if_include lo
#                          --mca oob_tcp_if_include lo`; MASTER_ADDR=127.0.0.1; GLOO_SOCKET_IFNAME=lo and
#                          NCCL_SOCKET_IFNAME=lo, UCX_NET_DEVICES=lo and FI_TCP_IFACE=lo unless set (the
#                          ranks' own MPI traffic: slackswap_ds agrees plans over MPI under an MPI
#                          launcher); a hostfile may then name only this machine
#   MASTER_ADDR            rendezvous host (default: first host of the hostfile, else 127.0.0.1;
#                          ignored with SLACKSWAP_LOOPBACK=1)
#   DS_ACCELERATOR         passed to every rank when set (cpu for CPU runs)
#   MPIEXEC                the launcher binary (default: mpiexec, else mpirun)
#   SLACKSWAP_MPI_FLAVOR   mpich | openmpi, to skip detection (`$MPIEXEC --version`)
#   PYTHON                 interpreter for *.py scripts (default: python3 on PATH)
set -euo pipefail

die() { echo "mpirun.sh: $*" >&2; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
nprocs="" ppn="" hostfile="" port="${MASTER_PORT:-29500}" dry_run=0
read -r -a extra <<<"${SLACKSWAP_MPI_ARGS:-}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|-np|--np|--nprocs) [[ $# -ge 2 ]] || die "$1 needs a value"; nprocs=$2; shift 2 ;;
        --ppn) [[ $# -ge 2 ]] || die "$1 needs a value"; ppn=$2; shift 2 ;;
        --hostfile|-f|--machinefile) [[ $# -ge 2 ]] || die "$1 needs a value"; hostfile=$2; shift 2 ;;
        --port|--master_port) [[ $# -ge 2 ]] || die "$1 needs a value"; port=$2; shift 2 ;;
        --mpi-args) [[ $# -ge 2 ]] || die "$1 needs a value"; read -r -a more <<<"$2"; extra+=("${more[@]}"); shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --) shift; break ;;
        -*) die "unknown option $1 (script arguments go after the script)" ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || die "no script given (try: launch/mpirun.sh -n 2 launch/train.py --deepspeed_config configs/slackswap.json)"
[[ -z "$nprocs" || "$nprocs" =~ ^[1-9][0-9]*$ ]] || die "-n wants a positive integer, got '$nprocs'"
[[ -z "$ppn" || "$ppn" =~ ^[1-9][0-9]*$ ]] || die "--ppn wants a positive integer, got '$ppn'"
[[ "$port" =~ ^[0-9]+$ ]] || die "--port wants a number, got '$port'"

# ---- launcher and its flavour -------------------------------------------------------------------
mpiexec=${MPIEXEC:-}
if [[ -z "$mpiexec" ]]; then
    mpiexec=$(command -v mpiexec || command -v mpirun || true)
    [[ -n "$mpiexec" ]] || die "neither mpiexec nor mpirun is on PATH (pip install mpich, or load your MPI module)"
fi
flavor=${SLACKSWAP_MPI_FLAVOR:-}
if [[ -z "$flavor" ]]; then
    version=$("$mpiexec" --version 2>&1 || true)
    if grep -qiE 'open mpi|openrte|open-rte|prrte' <<<"$version"; then flavor=openmpi
    elif grep -qiE 'hydra|mpich|intel\(r\) mpi' <<<"$version"; then flavor=mpich
    else die "cannot tell the MPI flavour of $mpiexec from --version; set SLACKSWAP_MPI_FLAVOR=mpich|openmpi"
    fi
fi
[[ "$flavor" == mpich || "$flavor" == openmpi ]] || die "SLACKSWAP_MPI_FLAVOR must be mpich or openmpi, got '$flavor'"

# ---- hostfile (DeepSpeed format: "host slots=N") ----------------------------------------------
hosts=() slots=()
if [[ -n "$hostfile" ]]; then
    [[ -f "$hostfile" ]] || die "hostfile $hostfile not found"
    while read -r line || [[ -n "$line" ]]; do
        line=${line%%#*}
        read -r h rest <<<"$line" || true
        [[ -n "${h:-}" ]] || continue
        s=1
        if [[ "${rest:-}" =~ slots=([0-9]+) ]]; then s=${BASH_REMATCH[1]}; fi
        hosts+=("$h"); slots+=("$s")
    done <"$hostfile"
    [[ ${#hosts[@]} -gt 0 ]] || die "hostfile $hostfile names no host"
fi

is_local_host() {
    case "$1" in
        localhost|localhost.localdomain|127.*|::1|"$(hostname 2>/dev/null)"|"$(hostname -s 2>/dev/null)") return 0 ;;
    esac
    return 1
}

loopback=0
if [[ "${SLACKSWAP_LOOPBACK:-0}" == 1 ]]; then loopback=1; fi
if [[ $loopback == 1 ]]; then
    for h in "${hosts[@]}"; do
        is_local_host "$h" || die "SLACKSWAP_LOOPBACK=1 but the hostfile names $h, which is not this machine"
    done
    master_addr=127.0.0.1
    # torch.distributed's sockets, and MPI's own (slackswap_ds agrees plans over MPI when mpi4py is
    # there): UCX (MPICH's default netmod here, Open MPI's pml ucx) and libfabric's tcp provider
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
    export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} FI_TCP_IFACE=${FI_TCP_IFACE:-lo}
elif [[ -n "${MASTER_ADDR:-}" ]]; then
    master_addr=$MASTER_ADDR
elif [[ ${#hosts[@]} -gt 0 ]]; then
    master_addr=${hosts[0]}
else
    master_addr=127.0.0.1
fi
if is_local_host "$master_addr" && [[ ${#hosts[@]} -le 1 ]]; then
    master_addr=127.0.0.1    # single machine: rendezvous on loopback, whatever the hostname resolves to
fi

if [[ -z "$nprocs" ]]; then
    if [[ ${#hosts[@]} -gt 0 ]]; then
        nprocs=0; for s in "${slots[@]}"; do nprocs=$((nprocs + s)); done
    elif command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ $n -gt 0 ]]; then
        nprocs=$n
    else
        nprocs=1
    fi
fi
if [[ -z "$ppn" && ${#hosts[@]} -gt 0 ]]; then ppn=${slots[0]}; fi

# ---- the per-rank command -----------------------------------------------------------------------
script=$1; shift
if [[ "$script" == *.py ]]; then
    python=${PYTHON:-$(command -v python3 || command -v python)}
    rank_cmd=("$here/rank_env.sh" "$python" -u "$script" "$@")
else
    rank_cmd=("$here/rank_env.sh" "$script" "$@")
fi

# Variables every rank needs; with a hostfile they must reach the other nodes too.
export MASTER_ADDR=$master_addr MASTER_PORT=$port
pass=(MASTER_ADDR MASTER_PORT)
for v in DS_ACCELERATOR OMP_NUM_THREADS GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME UCX_NET_DEVICES FI_TCP_IFACE \
         PYTHONPATH SLACKSWAP_LAUNCH_VERBOSE; do
    if [[ -n "${!v:-}" ]]; then pass+=("$v"); fi
done

cmd=("$mpiexec")
if [[ $flavor == mpich ]]; then
    cmd+=(-n "$nprocs")
    if [[ -n "$ppn" ]]; then cmd+=(-ppn "$ppn"); fi
    if [[ ${#hosts[@]} -gt 0 ]]; then
        list=""
        for i in "${!hosts[@]}"; do list+="${list:+,}${hosts[$i]}:${slots[$i]}"; done
        cmd+=(-hosts "$list")
    fi
    if [[ $loopback == 1 ]]; then cmd+=(-iface lo); fi
    for v in "${pass[@]}"; do cmd+=(-genv "$v" "${!v}"); done
else
    cmd+=(-np "$nprocs" --bind-to none)        # one core per rank (the default) starves torch threads
    if [[ -n "$ppn" ]]; then cmd+=(--map-by "ppr:$ppn:node"); fi
    if [[ -n "$hostfile" ]]; then cmd+=(--hostfile "$hostfile"); fi
    # (Open MPI 5 moved the out-of-band layer to PRRTE: there add --mpi-args "--prtemca oob_tcp_if_include lo")
    if [[ $loopback == 1 ]]; then cmd+=(--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo); fi
    if [[ $(id -u) == 0 ]]; then cmd+=(--allow-run-as-root); fi
    for v in "${pass[@]}"; do cmd+=(-x "$v"); done
fi
cmd+=("${extra[@]}" "${rank_cmd[@]}")

if [[ $dry_run == 1 || "${SLACKSWAP_LAUNCH_VERBOSE:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]}" >&2; echo >&2
fi
if [[ $dry_run == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
