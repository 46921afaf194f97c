"""Domain exceptions. Each message says what was expected, what was found, and what to do."""


import difflib
import importlib


def did_you_mean(word: str, choices: list[str]) -> str:
    """'did you mean "x"? ' for the closest choice (names that start with `word` first), or ''."""
    prefixed = [c for c in choices if c.lower().startswith(word.lower())] if word else []
    if len(prefixed) > 1:
        return "did you mean one of " + ", ".join(f'"{c}"' for c in prefixed) + "? "
    m = prefixed or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f'did you mean "{m[0]}"? ' if m else ""


class SlackSwapError(Exception):
    """Base class of every error slackswap_ds raises on purpose."""


class UnknownNameError(SlackSwapError, KeyError):
    """A preset name (workload, hardware, planner) that does not exist."""

    def __init__(self, kind: str, name: str, valid: list[str]):
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        super().__init__(f"unknown {kind} {name!r}; {did_you_mean(str(name), self.valid)}valid choices: "
                         f"{', '.join(self.valid)}")

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return self.args[0]


class InvalidFileError(SlackSwapError, ValueError):
    """A hardware, profile or plan file that is malformed."""


class ProfileError(SlackSwapError, ValueError):
    """A StepProfile whose ops and activations do not fit together."""


class PlanError(SlackSwapError, ValueError):
    """A Plan that does not fit the profile it is applied to, or is malformed."""


class BudgetInfeasibleError(SlackSwapError):
    """A planner cannot meet the memory budget at all (e.g. the non-recomputable bytes alone exceed it)."""


class MissingExtraError(SlackSwapError, ImportError):
    """An optional dependency that cannot be imported: the message names the extra that installs it."""


def import_extra(module: str, extra: str, needed_by: str):
    """`module`, imported; if it cannot be, a MissingExtraError saying what needs it and
    `pip install 'slackswap_ds[extra]'` (setup.cfg's extras)."""
    top = module.split(".")[0]
    try:
        importlib.import_module(top)  # first: a package set to None in sys.modules hides its loaded submodules too
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(f"{needed_by} needs {top}, which cannot be imported here ({e}): "
                                f"pip install 'slackswap_ds[{extra}]'") from e
