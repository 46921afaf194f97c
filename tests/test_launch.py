"""The launch scripts under launch/: the MPI wrapper (run for real, on loopback, against the DeepSpeed
launcher), its per-rank shim, and the Slurm batch script (syntax, and the commands it would build)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import ROOT, cpu_env, deepspeed_line, free_loopback_port, run_launch, sharing

LAUNCH = ROOT / "launch"
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")


def mpi_flavor() -> str | None:
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "openrte" in text or "prrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "mpich"
    return None


def run(cmd: list[str], env: dict, losses: Path) -> tuple[list[float], str]:
    out = run_launch(cmd, env)
    return json.loads(losses.read_text()), out


TRAIN_ARGS = ["--deepspeed_config", "configs/slackswap.json", "--steps", "4"]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> list[float]:
    """The same 4 steps under `deepspeed --num_gpus 2` (DeepSpeed's local launcher, no MPI)."""
    pytest.importorskip("deepspeed")
    if mpi_flavor() is None:
        pytest.skip("no mpiexec / mpirun (MPICH or Open MPI) on PATH")
    ref_file = tmp_path_factory.mktemp("reference") / "deepspeed.json"
    ref, _ = run(deepspeed_line(2, "launch/train.py", *TRAIN_ARGS, "--losses", str(ref_file)), cpu_env(), ref_file)
    assert len(ref) == 4
    return ref


@sharing("reference_losses")
def test_mpirun_wrapper_matches_the_deepspeed_launcher(tmp_path, reference_losses):
    flavor = mpi_flavor()
    ref = reference_losses
    mpi_file = tmp_path / "mpirun.json"
    losses, out = run([BASH, str(LAUNCH / "mpirun.sh"), "-n", "2", "--port", str(free_loopback_port()), "launch/train.py",
                       *TRAIN_ARGS, "--losses", str(mpi_file)],
                      cpu_env(SLACKSWAP_LOOPBACK="1", SLACKSWAP_LAUNCH_VERBOSE="1", PYTHON=sys.executable),
                      mpi_file)
    assert losses == ref
    # loopback options in the launch command, both ranks mapped from the launcher's variables,
    # and no mpi4py discovery (which would take MASTER_ADDR from `hostname -I`)
    if flavor == "mpich":
        assert "-iface lo" in out
    else:
        assert "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo" in out
    for rank in (0, 1):
        assert f"RANK={rank} WORLD_SIZE=2 LOCAL_RANK={rank} LOCAL_SIZE=2 MASTER_ADDR=127.0.0.1" in out
    assert "Discovered MPI settings" not in out
    assert out.count("slackswap rank") == 1  # rank 0's plan line; rank 1's share is the same
    assert out.count("agreed over MPI by 2 ranks") == 1  # an MPI launch: the plan was agreed over MPI


@pytest.mark.slow  # (suite time: the mpirun wrapper above launches MPICH's Hydra the same way)
@sharing("reference_losses")
def test_deepspeed_mpich_launcher_on_loopback(tmp_path, reference_losses):
    """The `deepspeed --launcher mpich --hostfile launch/hostfile.localhost ...` command of docs/multi_node.md."""
    if mpi_flavor() != "mpich" or shutil.which("mpirun") is None:
        pytest.skip("DeepSpeed's MPICH launcher needs MPICH's mpirun on PATH")
    losses_file = tmp_path / "mpich.json"
    losses, out = run(deepspeed_line(None, "--launcher", "mpich", "--launcher_args=-iface lo", "--no_ssh_check",
                                     "--force_multi", "--hostfile", "launch/hostfile.localhost", "launch/train.py",
                                     *TRAIN_ARGS, "--losses", str(losses_file)),
                      cpu_env(UCX_NET_DEVICES="lo"), losses_file)
    cmd = next(line for line in out.splitlines() if "cmd = mpirun" in line)
    assert "-n 2 -ppn 2 -iface lo" in cmd and "-genv MASTER_ADDR 127.0.0.1" in cmd
    assert "-genv UCX_NET_DEVICES=lo" in cmd  # DeepSpeed forwards UCX_*: the ranks' MPI stays on lo too
    assert losses == reference_losses and out.count("slackswap rank") == 1
    assert out.count("agreed over MPI by 2 ranks") == 1


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "SLACKSWAP_LOOPBACK")}
    e.update({"MPIEXEC": "mpiexec-placeholder", "PYTHON": "python3", **env})
    return subprocess.run([BASH, str(LAUNCH / "mpirun.sh"), "--dry-run", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=60)


def test_wrapper_commands_for_both_mpi_flavours():
    script = ["launch/train.py", "--deepspeed_config", "configs/gpt2-xl.json"]
    p = dry_run("--hostfile", "launch/hostfile.example", *script, SLACKSWAP_MPI_FLAVOR="mpich")
    assert p.returncode == 0, p.stderr
    assert "-n 16 -ppn 8 -hosts worker-1:8\\,worker-2:8 -genv MASTER_ADDR worker-1 -genv MASTER_PORT 29500" in p.stderr
    assert "-iface" not in p.stderr and p.stderr.rstrip().endswith("configs/gpt2-xl.json")

    p = dry_run("--hostfile", "launch/hostfile.example", *script, SLACKSWAP_MPI_FLAVOR="openmpi",
                DS_ACCELERATOR="cuda")
    assert p.returncode == 0, p.stderr
    assert "-np 16 --bind-to none --map-by ppr:8:node --hostfile launch/hostfile.example" in p.stderr
    assert "-x MASTER_ADDR -x MASTER_PORT -x DS_ACCELERATOR" in p.stderr

    p = dry_run("-n", "2", *script, SLACKSWAP_MPI_FLAVOR="openmpi", SLACKSWAP_LOOPBACK="1", MASTER_ADDR="10.0.0.1")
    assert p.returncode == 0, p.stderr
    assert "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo" in p.stderr
    p = dry_run("-n", "2", *script, SLACKSWAP_MPI_FLAVOR="mpich", SLACKSWAP_LOOPBACK="1", MASTER_ADDR="10.0.0.1")
    assert "-n 2 -iface lo -genv MASTER_ADDR 127.0.0.1" in p.stderr  # loopback wins over MASTER_ADDR

    # loopback with a hostfile naming other machines is refused, and so are unknown options
    p = dry_run("--hostfile", "launch/hostfile.example", *script, SLACKSWAP_MPI_FLAVOR="mpich", SLACKSWAP_LOOPBACK="1")
    assert p.returncode == 2 and "worker-1, which is not this machine" in p.stderr
    assert dry_run("--frobnicate", *script, SLACKSWAP_MPI_FLAVOR="mpich").returncode == 2


@pytest.mark.parametrize("launcher_env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, "9 16 1 8"),
    # Hydra ranks started under Slurm inherit their proxy's SLURM_PROCID: the PMI variables win
    ({"PMI_RANK": "12", "PMI_SIZE": "16", "MPI_LOCALRANKID": "4", "MPI_LOCALNRANKS": "8", "SLURM_PROCID": "1",
      "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "12 16 4 8"),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"},
     "9 16 1 8"),
])
def test_rank_env_maps_launcher_variables(launcher_env, expected):
    env = {"PATH": os.environ["PATH"], "MASTER_ADDR": "node-1", **launcher_env}
    p = subprocess.run([BASH, str(LAUNCH / "rank_env.sh"), BASH, "-c",
                        'echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_SIZE $MASTER_ADDR $MASTER_PORT"'],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"{expected} node-1 29500"
    p = subprocess.run([BASH, str(LAUNCH / "rank_env.sh"), "true"], env={"PATH": os.environ["PATH"]},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no MPI/Slurm rank variable" in p.stderr


@pytest.mark.parametrize("script", ["slurm.sbatch", "mpirun.sh", "rank_env.sh"])
def test_scripts_parse(script):
    p = subprocess.run([BASH, "-n", str(LAUNCH / script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_hostfiles_parse_as_deepspeed_hostfiles():
    runner = pytest.importorskip("deepspeed.launcher.runner")
    assert dict(runner.fetch_hostfile(str(LAUNCH / "hostfile.localhost"))) == {"localhost": 2}
    assert dict(runner.fetch_hostfile(str(LAUNCH / "hostfile.example"))) == {"worker-1": 8, "worker-2": 8}


def test_sbatch_builds_the_srun_deepspeed_and_mpirun_commands(tmp_path):
    """Run launch/slurm.sbatch with stand-ins for scontrol, srun, deepspeed and mpiexec that only
    record their arguments: checks the hostfile, MASTER_ADDR and each mode's command line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && tr , "\\n" <<<"$3"\n')
    for name in ("srun", "mpiexec"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >>"{log}"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu001,gpu002",
            "SLURM_JOB_ID": "1234", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_CPUS_PER_TASK": "12",
            "SLACKSWAP_MPI_FLAVOR": "mpich", "MPIEXEC": str(bin_dir / "mpiexec"), "PYTHON": "python3"}
    calls = {}
    for mode in ("srun", "deepspeed", "mpirun"):
        log.write_text("")
        hostfile = tmp_path / f"hostfile-{mode}"
        p = subprocess.run([BASH, str(LAUNCH / "slurm.sbatch"), "--seed", "7"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**base, "LAUNCH": mode, "HOSTFILE": str(hostfile)})
        assert p.returncode == 0, p.stderr
        assert "MASTER_ADDR=gpu001 MASTER_PORT=21234" in p.stdout
        calls[mode] = log.read_text()
        if mode != "srun":
            assert hostfile.read_text() == "gpu001 slots=8\ngpu002 slots=8\n"
    tail = "--deepspeed_config configs/gpt2-xl.json --model gpt2 --layers 48 --hidden 1600 --heads 25 " \
           "--seq 1024 --vocab 50257 --steps 2000 --seed 7"
    assert calls["srun"].startswith("srun --nodes=2 --ntasks-per-node=8 --cpus-per-task=12 ")
    assert f"launch/rank_env.sh python -u launch/train.py {tail}" in calls["srun"]
    assert calls["deepspeed"].startswith("srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=96 ")
    assert "deepspeed --no_ssh --node_rank" in calls["deepspeed"] and tail in calls["deepspeed"]
    assert calls["mpirun"].startswith("mpiexec -n 16 -ppn 8 -hosts gpu001:8,gpu002:8 "
                                      "-genv MASTER_ADDR gpu001 -genv MASTER_PORT 21234 ")
    assert f"rank_env.sh python3 -u launch/train.py {tail}" in calls["mpirun"]
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([BASH, str(LAUNCH / "slurm.sbatch")], cwd=ROOT, capture_output=True, timeout=60, check=True,
                       env={**base, "LAUNCH": "pdsh"})


def test_the_readme_opens_with_its_two_commands_and_ci_runs_the_second():
    """The README's first code block is the two commands for a fresh machine (the main job on CPU,
    then the tests); `.ci/run` runs the second; then come what it does, the quickstarts, which budget
    to choose, the config reference and the status, with the way on to docs/ and the changelog."""
    readme = (ROOT / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(first) == 2 and "launch/train.py --deepspeed_config configs/slackswap.json" in first[0]
    assert first[1] == "python -m pip install -c configs/constraints-cpu.txt -e '.[test]' && python -m pytest"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pip install -q -c configs/constraints-cpu.txt -e '.[test]' && python -m pytest" in ci
    headings = [line for line in readme.splitlines() if line.startswith("## ")]
    assert headings[:3] == ["## What it does", "## Quickstart", "## Which budget to choose"]
    subheadings = [line for line in readme.splitlines() if line.startswith("### ")]
    assert subheadings[:3] == ["### A plain DeepSpeed script", "### Hugging Face Trainer", "### Accelerate"]
    config = headings.index("## The `slackswap` config section")
    assert config < headings.index("## Status") and "](docs/index.md)" in readme and "](CHANGELOG.md)" in readme
