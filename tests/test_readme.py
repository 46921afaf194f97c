"""The claims of the README and of the pages in docs/ that a test can check without running a job:
every `slackswap` command they show parses and names presets and planners that exist, every option
they mention is one, every file they point to is there, every JSON config they show loads, every
Python block compiles, every environment variable they name is read by the package. (The README's
first screen: tests/test_launch.py; the simulated table in docs/simulator.md: tests/test_cli.py; the
README's config table: tests/test_config.py; links between the pages: tests/test_docs.py.)"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

from slackswap_ds.cli import build_parser
from slackswap_ds.config import load_config
from slackswap_ds.planners import PLANNERS
from slackswap_ds.workloads import workload_names

ROOT = Path(__file__).resolve().parents[1]
# the README and every page of docs/, read as one text (the README's topics moved there)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n".join(page.read_text() for page in PAGES)
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)


def slackswap_commands() -> list[str]:
    """Every whole `slackswap ...` command line of the README's code blocks (`$ slackswap ...`, or
    after `&&` in a shell line)."""
    found = []
    for lang, block in BLOCKS:
        for line in block.splitlines():
            line = line.strip()
            if line.startswith("$ slackswap "):
                found.append(line[2:])
            elif lang == "bash":
                found += [part.strip() for part in line.split("&&") if part.strip().startswith("slackswap ")]
    return found


COMMANDS = slackswap_commands()
# in the text, often a fragment ("`slackswap simulate | plan`" names the two commands)
MENTIONED = [m for m in re.findall(r"`(slackswap (?:simulate|plan)\b[^`]*)`", README) if "|" not in m]


def test_the_readme_shows_slackswap_commands():
    assert len(COMMANDS) >= 4 and any(c.startswith("slackswap plan --plan-file") for c in COMMANDS)
    assert len(MENTIONED) >= 4


def _names_exist(command: str, args) -> None:
    workloads = [args.workload] if isinstance(args.workload, str) else args.workload or []
    for name in workloads:
        assert name == "all" or name in workload_names(), f"{command}: no workload {name!r}"
    planners = [args.planner] if isinstance(args.planner, str) else args.planner or []
    assert all(p in PLANNERS for p in planners), command
    for path in getattr(args, "model", None) or []:
        assert (ROOT / path).exists(), f"{command}: no {path}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_slackswap_command_in_the_readme_parses_and_names_what_exists(command):
    _names_exist(command, build_parser().parse_args(shlex.split(command.split("#")[0])[1:]))


@pytest.mark.parametrize("mention", MENTIONED)
def test_every_slackswap_option_the_readme_mentions_exists(mention):
    """`slackswap plan --plan-file`, `slackswap simulate --budget auto`, `slackswap plan -w W -b B -o
    plan.json`: every option is one of its command's, and with placeholders (W, B) filled in and the
    options it needs added, it parses."""
    words = shlex.split(mention)[1:]
    command = build_parser()._subparsers._group_actions[0].choices[words[0]]
    options = {o for action in command._actions for o in action.option_strings}
    assert {w for w in words if w.startswith("-")} <= options, mention
    if words[-1].startswith("-"):
        return  # an option named without its value ("`--plan-file`"): named is enough
    filled = [{"W": "bert-large", "B": "0.5"}.get(w, w) for w in words]
    if words[0] == "plan" and "-o" not in words:
        filled += ["-o", "-"]
    _names_exist(mention, build_parser().parse_args(filled))


def test_every_file_the_readme_points_to_is_there():
    # (not a path a program printed: "wrote /work/main/benchmarks/results/...")
    paths = set(re.findall(r"(?<![/\w])((?:benchmarks|launch|configs|tests|slackswap_ds)/[\w./-]*\w/?)", README))
    assert len(paths) > 20
    # (benchmarks/results/ holds what the benchmarks write when they run: not in the repository)
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not p.startswith("benchmarks/results/"))
    assert missing == []


def test_every_json_config_in_the_readme_loads():
    shown = [block for lang, block in BLOCKS if lang == "json"]
    assert shown
    for block in shown:
        text = block.strip()
        data = json.loads(text if text.startswith("{") else "{" + text + "}")
        load_config(data)  # a ConfigError names what is wrong


def test_every_python_block_in_the_readme_compiles():
    shown = [block for lang, block in BLOCKS if lang == "python"]
    assert shown
    for block in shown:
        ast.parse(block)


def test_every_environment_variable_the_readme_names_is_read_by_the_package():
    source = "\n".join(p.read_text() for folder in ("slackswap_ds", "launch") for p in (ROOT / folder).rglob("*")
                       if p.is_file() and p.suffix in (".py", ".sh", ".sbatch"))
    named = set(re.findall(r"\bSLACKSWAP_[A-Z_]+\b", README))
    assert named and all(name in source for name in named), named
